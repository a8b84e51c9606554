"""One resolved layout: the size of every mesh dimension, the ZeRO stage, the micro-batches and the memory
savers — the one type the config, the mesh, the planner, its performance model and `layout: auto` share.

`Layout.from_config(parallel, world_size)` resolves the sizes a config asks for (one may be -1, "the rest"),
and the engine adds the ZeRO stage the run really gets; `Layout.planned(...)` makes one of the planner's
candidates, which `planning.plan.to_config` turns back into the config keys that ask for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from meshkit.config.schema import PARALLEL_DIMS, ParallelConfig, PipelineConfig
from meshkit.core.errors import MeshkitError

Recompute = Literal["none", "selective", "full"]  # activation checkpointing
Offload = Literal["none", "cpu", "nvme"]  # where optimizer states live
SINGLE_STAGE = {"gpipe", "1f1b"}  # one model chunk per rank; the other schedules take several


class MeshError(MeshkitError):
    """Parallel sizes that do not fit the world; the message says what to change."""


class PipelineError(MeshkitError):
    """A pipeline layout that cannot run; the message says what to change."""


def chunks_per_rank(cfg: PipelineConfig) -> int:
    """Model chunks each rank holds: 1 for GPipe and 1F1B, `stages_per_rank` (default 2) for the others."""
    if cfg.schedule in SINGLE_STAGE:
        if cfg.stages_per_rank not in (None, 1):
            raise PipelineError(
                f"schedule {cfg.schedule} runs one stage per rank, not {cfg.stages_per_rank}: "
                "use interleaved_1f1b for several"
            )
        return 1
    chunks = cfg.stages_per_rank or 2
    if cfg.schedule == "zbv_zero_bubble" and chunks != 2:
        raise PipelineError(f"zbv_zero_bubble runs exactly 2 stages per rank (a V shape), not {chunks}")
    if chunks < 2:
        raise PipelineError(f"schedule {cfg.schedule} interleaves several stages per rank: set stages_per_rank >= 2")
    return chunks


def check_pipeline(cfg: PipelineConfig, pp: int, local_batch: int | None = None, grad_accum_steps: int = 1) -> int:
    """The rules a pipeline of `pp` stages checks before it runs (the planner's proposals pass the same);
    returns the micro-batches per step. `local_batch`: the samples each pipeline step splits, when known."""
    if grad_accum_steps > 1:
        raise PipelineError(
            "pipeline parallel accumulates over its micro-batches: set grad_accum_steps=1 and raise "
            "pipeline.microbatches instead"
        )
    chunks_per_rank(cfg)
    microbatches = cfg.microbatches or pp
    if microbatches < pp:
        raise PipelineError(f"pipeline.microbatches={microbatches} must be at least pp={pp}")
    if local_batch is not None and local_batch % microbatches:
        raise PipelineError(
            f"the local batch of {local_batch} does not split into pipeline.microbatches={microbatches}"
            ": make the per-rank batch size a multiple of it"
        )
    return microbatches


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choices_text(values: list[int]) -> str:
    """'1, 2 or 4': the sizes a one-line error offers."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]


@dataclass(frozen=True)
class Layout:
    """Resolved sizes (no -1 left) in mesh order, and how each rank's step runs in them."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    zero_stage: int = 0
    microbatches: int = 1  # per optimizer step and rank: pipeline micro-batches (pp > 1) or accumulation steps
    stages_per_rank: int = 1  # model chunks per rank (> 1: the interleaved 1F1B schedule)
    activation_checkpointing: Recompute = "none"
    offload: Offload = "none"
    ep: int = 1  # expert parallel: a factor of dp × cp (the ranks that see other tokens), not a mesh size of its own

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> Layout:
        """The mesh sizes of a `parallel` section on `world_size` ranks (the -1 one takes the rest)."""
        sizes = {name: getattr(cfg, name) for name in PARALLEL_DIMS}
        for name, size in sizes.items():
            if size != -1 and world_size % size:
                choices = choices_text(divisors(world_size))
                raise MeshError(f"{name}={size} does not divide world size {world_size}: choose {choices}")
        fixed = math.prod(size for size in sizes.values() if size != -1)
        rest = [name for name, size in sizes.items() if size == -1]
        if rest:
            if world_size % fixed:
                named = " × ".join(f"{n}={s}" for n, s in sizes.items() if s not in (-1, 1))
                raise MeshError(
                    f"{named} = {fixed} does not divide world size {world_size}: make the product divide it"
                )
            sizes[rest[0]] = world_size // fixed
        elif fixed != world_size:
            named = " × ".join(f"{n}={s}" for n, s in sizes.items())
            raise MeshError(
                f"parallel sizes {named} multiply to {fixed}, but the world size is {world_size}: "
                f"make them multiply to {world_size}, or set one of them to -1 (the rest)"
            )
        tokens = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"]
        if tokens % cfg.ep:
            raise MeshError(
                f"ep={cfg.ep} must divide the {tokens} ranks that see other tokens (dp_replicate × dp_shard × cp): "
                f"choose {choices_text(divisors(tokens))}"
            )
        return cls(**sizes, ep=cfg.ep)

    @classmethod
    def planned(
        cls,
        dp: int,
        tp: int,
        pp: int,
        cp: int,
        zero_stage: int,
        microbatches: int,
        activation_checkpointing: Recompute = "none",
        offload: Offload = "none",
        stages_per_rank: int = 1,
        ep: int = 1,
    ) -> Layout:
        """A planner's layout: `dp` data-parallel ranks, sharded (dp_shard) under ZeRO-3, replicated otherwise."""
        replicate, shard = (1, dp) if zero_stage == 3 else (dp, 1)
        return cls(pp, replicate, shard, cp, tp, zero_stage, microbatches, stages_per_rank, activation_checkpointing,
                   offload, ep)  # fmt: skip

    # ------------------------------------------------------------------ sizes
    def mesh_sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in PARALLEL_DIMS}

    def as_dict(self) -> dict[str, int]:
        """The mesh sizes (what a checkpoint records as its layout)."""
        return self.mesh_sizes()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in PARALLEL_DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        """Ranks that see different data: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    # ------------------------------------------------------------------ words
    def describe(self) -> str:
        """Compact mesh, e.g. 'dp_replicate4' or 'pp2 × dp_shard2 × tp2'; 'single process' for world 1."""
        parts = [f"{name}{size}" for name, size in self.mesh_sizes().items() if size > 1]
        text = " × ".join(parts) if parts else "single process"
        return f"{text}, experts over ep{self.ep}" if self.ep > 1 else text

    def summary(self) -> str:
        """The planner's words: 'dp4 tp2 pp1 cp1 ZeRO-1 accum8 AC selective'."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"cp{self.cp}", f"ZeRO-{self.zero_stage}"]
        parts[4:4] = [f"ep{self.ep}"] if self.ep > 1 else []
        parts.append(f"{'m' if self.pp > 1 else 'accum'}{self.microbatches}")
        if self.stages_per_rank > 1:
            parts.append(f"interleaved v{self.stages_per_rank}")
        if self.activation_checkpointing != "none":
            parts.append(f"AC {self.activation_checkpointing}")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        return " ".join(parts)

    def as_json(self) -> dict[str, Any]:
        keys = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "microbatches", "stages_per_rank")
        out: dict[str, Any] = {key: getattr(self, key) for key in keys}
        out.update(activation_checkpointing=self.activation_checkpointing, offload=self.offload)
        return out
