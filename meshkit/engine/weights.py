"""The weights side of `Engine` (its `weights` component): the user's module, full state dicts, exports and memory
figures."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.checkpoint.model_export import save_model_weights
from meshkit.core.io import write_atomically
from meshkit.engine.context import EngineComponent
from meshkit.engine.prepared_objects import EngineError
from meshkit.models import hf_adapter
from meshkit.parallel.compose import unwrap
from meshkit.parallel.materialize import set_local
from meshkit.parallel.tensor.storage import SplitWeights
from meshkit.planning.activation_report import ActivationReport
from meshkit.runtime import collectives
from meshkit.runtime.dtensors import local_tensor
from meshkit.runtime.memory import memory_report


class Weights(EngineComponent):
    """Reads the prepared models (and what was remembered about each) through the shared context."""

    def unwrap_model(self, model: nn.Module | None = None) -> nn.Module:
        return unwrap(self.ctx.objects.only_model(model))

    def full_state_dict(
        self, model: nn.Module | None = None, keys: Callable[[str], bool] | None = None
    ) -> dict[str, torch.Tensor]:
        """The complete, unsharded state dict of a prepared model (same keys as the user's module); with `keys`,
        only the entries it accepts (e.g. adapter weights), so nothing else is gathered.

        Collective under ZeRO-3: every rank must call it (each shard is all-gathered).
        """
        prepared = self.ctx.objects.only_model(model)
        objects, mesh = self.ctx.objects, self.ctx.mesh
        local = {k: v for k, v in unwrap(prepared).state_dict().items() if keys is None or keys(k)}
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in local.items()}
        split = objects.split_weights.get(id(prepared), SplitWeights())
        full = {name: split.to_canonical(name, tensor) for name, tensor in full.items()}
        if mesh.size("pp") > 1:  # each stage holds other parameters: collect all of them
            for part in collectives.gather_object(full, mesh.group("pp")):
                full.update(part)
        return full

    @torch.no_grad()
    def load_full_state_dict(self, tensors: Mapping[str, torch.Tensor], model: nn.Module | None = None) -> list[str]:
        """Copy complete (unsharded) tensors into a prepared model, under the user's module's names: every rank
        passes the same tensors and keeps its own part of each (a ZeRO-3 or tensor-parallel shard). Returns the
        names this rank's model does not hold (another pipeline stage's, or none of the model's)."""
        prepared = self.ctx.objects.only_model(model)
        objects = self.ctx.objects
        split = objects.split_weights.get(id(prepared), SplitWeights())
        held = dict(unwrap(prepared).named_parameters())
        for name, full in tensors.items():
            if name in held:
                target = held[name]
                if tuple(full.shape) != tuple(target.shape):
                    raise EngineError(f"'{name}' has shape {tuple(full.shape)}; the model has {tuple(target.shape)}")
                local = local_tensor(target)
                stored = split.to_storage(name, full)  # (a fused weight in tensor parallel's order)
                set_local(target, stored.to(device=local.device, dtype=local.dtype))
        return sorted(set(tensors) - set(held))

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now for `params`, `grads` and `optimizer` state, its `rss`/`peak_rss`, and the
        resident size when `prepare` was first called (`start_rss`) and the peak when the training loop ended
        (`train_peak_rss`, before any export): what the training step's tensors added is at most
        `train_peak_rss - start_rss`."""
        objects = self.ctx.objects
        report = memory_report(objects.models, [opt.optimizer for opt in objects.optimizers])
        return report | {"start_rss": objects.start_rss, "train_peak_rss": objects.train_peak_rss or report["peak_rss"]}

    def activation_report(self) -> ActivationReport:
        """Measure the activations kept for backward by the step(s) run inside `with` (bytes on this rank):

            with engine.activation_report() as report:
                engine.train_step(batch)
            report.as_dict()  # saved_bytes, recompute_peak_bytes, peak_bytes, per-block figures

        Under torch.compile the total is what the compiled graph saves, with no per-block split (eager has one).
        """
        return ActivationReport(self.ctx.objects.models, self.ctx.objects.checkpointed, self.ctx.config.blocks)

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
        prepared = self.ctx.objects.only_model(model)
        objects, mesh = self.ctx.objects, self.ctx.mesh
        split = objects.split_weights.get(id(prepared), SplitWeights())
        merges = objects.adapter_merges.get(id(prepared), {}) if merge_adapters else {}
        aliases = objects.tied_aliases.get(id(prepared), {})  # a tied weight is written once, as Hugging Face does
        index = save_model_weights(prepared, mesh, split, out_dir, max_shard_size, merges, aliases)
        user_module = objects.user_modules.get(id(prepared))
        if mesh.info.rank == 0 and user_module is not None:
            for name, text in hf_adapter.config_files(user_module).items():
                write_atomically(Path(out_dir) / name, text=text)
        return index
