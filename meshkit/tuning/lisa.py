"""LISA — layerwise importance sampling (Axolotl's `lisa_n_layers`, `lisa_step_interval`, `lisa_layers_attribute`):
a full fine-tune in which only `lisa_n_layers` of the model's blocks train at a time, drawn anew every
`lisa_step_interval` steps; embeddings, final norm and head train throughout.

Axolotl switches `requires_grad` off on the other blocks. Here the engine drops their gradients before the clip
norm and the optimizer step instead (`Engine.leave_out_of_steps`): the optimizer skips a parameter without a
gradient, so every update — moments, weight decay, the clip norm — is the one freezing gives, in every layout
(DDP's and FSDP's reductions are built once and never see a parameter change kind). The gradients of the frozen
blocks are still computed, so it saves no memory or time over the full fine-tune: what it gives is LISA's updates.

The draw is seeded by the run's seed and the window's number, the same on every rank and after a resume.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import nn

from meshkit.config.section import Section
from meshkit.core.errors import MeshkitError
from meshkit.engine.engine import Engine
from meshkit.models.blocks import find_blocks
from meshkit.models.structure import describe
from meshkit.parallel.compose import unwrap


class LisaSettings(Section):
    """LISA's keys (Axolotl's names)."""

    lisa_n_layers: int | None = Field(None, ge=1, description="LISA: blocks trained at a time (the rest frozen)")
    lisa_step_interval: int | None = Field(None, ge=1, description="LISA: every how many steps new blocks are drawn")
    lisa_layers_attribute: str | None = Field(
        None, description="LISA: the block list's path (e.g. model.layers); null = the model's blocks"
    )

    @model_validator(mode="after")
    def _lisa_keys_together(self) -> LisaSettings:
        """LISA needs both how many blocks train and how often they change."""
        if (self.lisa_n_layers is None) != (self.lisa_step_interval is None):
            raise ValueError(
                "LISA needs lisa_n_layers (blocks trained at a time) and lisa_step_interval (every how many steps "
                "they change): set both, or neither"
            )
        return self

    @property
    def samples_layers(self) -> bool:
        return self.lisa_n_layers is not None


class LayerSamplingError(MeshkitError):
    """The model has no block list LISA can sample; the message says what to set."""


class LayerSampling:
    """Which blocks train in which window of steps; `before_step` is the loop's hook."""

    def __init__(self, engine: Engine, path: str, blocks: int, layers: int, interval: int, seed: int) -> None:
        self.engine, self.path, self.blocks, self.layers, self.interval, self.seed = (
            engine, path, blocks, layers, interval, seed,
        )  # fmt: skip
        self.window = -1
        self.chosen: tuple[int, ...] = ()

    @classmethod
    def of(cls, engine: Engine, model: nn.Module, attribute: str | None, layers: int, interval: int) -> LayerSampling:
        """For `model` before `engine.prepare`: its block list at `attribute`, or where the structure layer finds
        it (a peft model's path under its wrapper is found either way)."""
        path = describe(model).blocks if attribute is None else _under_wrappers(model, attribute)
        if path is None:
            raise LayerSamplingError(f"{type(model).__name__} has no block list for LISA: set lisa_layers_attribute")
        _, container = find_blocks(model, path)
        return cls(engine, path, len(container), layers, interval, engine.config.seed)

    def draw(self, window: int) -> tuple[int, ...]:
        """The blocks that train in `window` (steps window × interval onwards)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + window)
        return tuple(sorted(torch.randperm(self.blocks, generator=generator)[: self.layers].tolist()))  # (all, if more)

    def before_step(self, step: int) -> None:
        window = step // self.interval
        if window == self.window:
            return
        self.window, self.chosen = window, self.draw(window)
        resting = [
            param
            for model in self.engine.ctx.objects.models
            for name, param in unwrap(model).named_parameters()
            if self._block_of(name) not in (None, *self.chosen)
        ]
        self.engine.leave_out_of_steps(resting)

    def _block_of(self, name: str) -> int | None:
        prefix = f"{self.path}." if self.path else ""
        if not name.startswith(prefix):
            return None
        index = name[len(prefix) :].split(".", 1)[0]
        return int(index) if index.isdigit() else None

    def describe(self) -> str:
        if self.layers >= self.blocks:
            return (
                f"LISA: lisa_n_layers={self.layers} asks for every one of the model's {self.blocks} blocks "
                f"({self.path}): every block trains at every step, a full fine-tune"
            )
        return (
            f"LISA: {self.layers} of {self.blocks} blocks ({self.path}) train at a time, drawn anew every "
            f"{self.interval} steps (the others' gradients are dropped before each update)"
        )


def _under_wrappers(model: nn.Module, attribute: str) -> str:
    """`attribute` as a path in `model`, or under the wrappers a peft model adds (base_model.model.)."""
    names = {name for name, _ in model.named_modules()}
    for prefix in ("", "base_model.model."):
        if prefix + attribute in names:
            return prefix + attribute
    raise LayerSamplingError(
        f"lisa_layers_attribute: the model has no module '{attribute}': give its block list's path"
    )
