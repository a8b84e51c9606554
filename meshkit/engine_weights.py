"""The weights side of `Engine`: the user's module, full state dicts, exports and memory figures."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit import collectives
from meshkit.activation_report import ActivationReport
from meshkit.checkpoint.model_export import save_model_weights
from meshkit.errors import MeshkitError
from meshkit.export import write_atomically
from meshkit.memory import memory_report
from meshkit.models import hf_adapter
from meshkit.parallel.compose import unwrap
from meshkit.parallel.materialize import set_local
from meshkit.parallel.tensor_auto import restore_fused_qkv


class EngineError(MeshkitError):
    """Wrong use of the engine; the message says what to do instead."""


class WeightsMixin:
    """Mixed into `Engine`; uses its prepared models and optimizers, its mesh and config."""

    _models: list[nn.Module]
    _optimizers: list[Any]
    _fused_qkv: dict[int, dict[str, int]]
    _adapter_merges: dict[int, dict[str, Any]]
    _tied_aliases: dict[int, dict[str, str]]
    _user_modules: dict[int, nn.Module]
    _checkpointed: list[Any]
    mesh: Any
    config: Any

    @staticmethod
    def _only(kind: str, registry: list[Any]) -> Any:
        if len(registry) != 1:
            raise EngineError(
                f"this call needs exactly one prepared {kind}, found {len(registry)}: pass the one you mean"
            )
        return registry[0]

    def unwrap_model(self, model: nn.Module | None = None) -> nn.Module:
        return unwrap(model if model is not None else self._only("model", self._models))

    def full_state_dict(
        self, model: nn.Module | None = None, keys: Callable[[str], bool] | None = None
    ) -> dict[str, torch.Tensor]:
        """The complete, unsharded state dict of a prepared model (same keys as the user's module); with `keys`,
        only the entries it accepts (e.g. adapter weights), so nothing else is gathered.

        Collective under ZeRO-3: every rank must call it (each shard is all-gathered).
        """
        prepared = model if model is not None else self._only("model", self._models)
        local = {k: v for k, v in unwrap(prepared).state_dict().items() if keys is None or keys(k)}
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in local.items()}
        for name, dim in self._fused_qkv.get(id(prepared), {}).items():
            if name in full:
                full[name] = restore_fused_qkv(full[name], self.mesh.size("tp"), dim)
        if self.mesh.size("pp") > 1:  # each stage holds other parameters: collect all of them
            for part in collectives.gather_object(full, self.mesh.group("pp")):
                full.update(part)
        return full

    @torch.no_grad()
    def load_full_state_dict(self, tensors: Mapping[str, torch.Tensor], model: nn.Module | None = None) -> list[str]:
        """Copy complete (unsharded) tensors into a prepared model, under the user's module's names: every rank
        passes the same tensors and keeps its own part of each (a ZeRO-3 or tensor-parallel shard). Returns the
        names this rank's model does not hold (another pipeline stage's, or none of the model's)."""
        prepared = model if model is not None else self._only("model", self._models)
        if self._fused_qkv.get(id(prepared)) and any(name in tensors for name in self._fused_qkv[id(prepared)]):
            raise EngineError("load_full_state_dict cannot fill fused q/k/v weights split by tensor parallel")
        held = dict(unwrap(prepared).named_parameters())
        for name, full in tensors.items():
            if name in held:
                target = held[name]
                if tuple(full.shape) != tuple(target.shape):
                    raise EngineError(f"'{name}' has shape {tuple(full.shape)}; the model has {tuple(target.shape)}")
                local = target.to_local() if isinstance(target, DTensor) else target
                set_local(target, full.to(device=local.device, dtype=local.dtype))
        return sorted(set(tensors) - set(held))

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now for `params`, `grads` and `optimizer` state, and its `rss`/`peak_rss`."""
        return memory_report(self._models, [opt.optimizer for opt in self._optimizers])

    def activation_report(self) -> ActivationReport:
        """Measure the activations kept for backward by the step(s) run inside `with` (bytes on this rank):

            with engine.activation_report() as report:
                engine.train_step(batch)
            report.as_dict()  # saved_bytes, recompute_peak_bytes, peak_bytes, per-block figures

        Under torch.compile the total is what the compiled graph saves, with no per-block split (eager has one).
        """
        return ActivationReport(self._models, self._checkpointed, self.config.blocks)

    def save_model(
        self,
        out_dir: str | os.PathLike[str],
        model: nn.Module | None = None,
        max_shard_size: int | str = "2GB",
        merge_adapters: bool = True,
    ) -> Path:
        """Write the full weights as safetensors shards plus `model.safetensors.index.json` (Hugging Face
        layout), from any layout; for a transformers model also `config.json` and `generation_config.json`,
        so that `from_pretrained(out_dir)` loads it. LoRA adapters are merged into their base weights unless
        `merge_adapters=False`. Collective: every rank calls it; the main process writes, one shard at a time.
        """
        prepared = model if model is not None else self._only("model", self._models)
        fused = self._fused_qkv.get(id(prepared), {})
        merges = self._adapter_merges.get(id(prepared), {}) if merge_adapters else {}
        aliases = self._tied_aliases.get(id(prepared), {})  # a tied weight is written once, as Hugging Face does
        index = save_model_weights(prepared, self.mesh, fused, out_dir, max_shard_size, merges, aliases)
        user_module = self._user_modules.get(id(prepared))
        if self.mesh.info.rank == 0 and user_module is not None:
            for name, text in hf_adapter.config_files(user_module).items():
                write_atomically(Path(out_dir) / name, text=text)
        return index
