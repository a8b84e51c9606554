"""Axolotl keys that set several meshkit settings: `deepspeed:` (a DeepSpeed JSON, read by meshkit's importer),
`fsdp`/`fsdp_config`/`fsdp_version` (read as Accelerate's FSDP block), the trackers, `gradient_checkpointing_kwargs`.

Each reader writes into a `Sink`: meshkit settings with the key they came from, recipe settings, and notes. What a
nested file sets yields to the config's own top-level keys (`bf16: true` beside a DeepSpeed file agrees or wins).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshkit.config.importing.accelerate import read_fsdp_config
from meshkit.config.importing.deepspeed import read_deepspeed
from meshkit.config.importing.result import Imported, ImportingError

# Axolotl's stock deepspeed_configs/*.json, for a config that names one without the file beside it.
STOCK_DEEPSPEED: dict[str, dict[str, Any]] = {
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero1_torch_compile": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero2_torch_compile": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
    "zero3_bf16": {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
    "zero3_cpuoffload": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
    "zero3_bf16_cpuoffload_params": {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
        "bf16": {"enabled": True},
    },
    "zero3_bf16_cpuoffload_all": {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": True},
    },
}
_FSDP_LIST = {"full_shard": 3, "shard_grad_op": 2, "hybrid_shard": 3, "hybrid_shard_zero2": 2, "no_shard": 0}


@dataclass
class Sink(Imported):
    """What the readers found: meshkit settings (`values`, `origins`), recipe settings, trackers and notes."""

    base_dir: Path = Path(".")
    recipe: dict[str, Any] = field(default_factory=dict)
    trackers: list[str] = field(default_factory=list)

    def skipped_note(self, what: str) -> None:
        """The keys a nested block holds that have no effect here, as one notice line."""
        if self.skipped:
            listed = "; ".join(f"{origin} ({why})" for origin, why in self.skipped)
            self.notes.append(f"{what}: no effect here: {listed}")
            self.skipped = []


def _find(name: str, base_dir: Path) -> Path | None:
    path = Path(name).expanduser()
    for candidate in (path, base_dir / path):
        if candidate.is_file():
            return candidate
    return None


def deepspeed(name: str, value: Any, sink: Sink) -> None:
    if isinstance(value, dict):
        data, label = value, "deepspeed"
    else:
        path = _find(str(value), sink.base_dir)
        stem = Path(str(value)).stem
        if path is None and stem in STOCK_DEEPSPEED:
            data, label = STOCK_DEEPSPEED[stem], f"deepspeed: {value}"
            sink.notes.append(f"deepspeed: {value} is not here; read as Axolotl's stock {stem}.json")
        elif path is None:
            raise ImportingError(f"deepspeed: {value}: no such file (relative to here or to the config's directory)")
        else:
            try:
                data = json.loads(path.read_text())
            except ValueError as err:
                raise ImportingError(f"deepspeed: {path} is not valid JSON: {err}") from None
            label = f"deepspeed: {path.name}"
    read_deepspeed(data, sink, prefix=f"{label}: ")
    # DeepSpeed's `auto` values are filled from the config's own keys, as the trainer fills them: not news
    sink.notes[:] = [note for note in sink.notes if ": auto — " not in note]
    sink.skipped_note(label)


def fsdp(name: str, value: Any, sink: Sink) -> None:
    if name == "fsdp_version":
        if str(value) == "1":
            sink.notes.append("fsdp_version: 1 — meshkit runs FSDP2 (fully_shard) with the same settings")
        return
    if name == "fsdp":
        words = value.split() if isinstance(value, str) else [str(word) for word in value]
        for word in words:
            if word in _FSDP_LIST:
                sink.set("sharding.zero_stage", _FSDP_LIST[word], f"fsdp: {word}")
                if word.startswith("hybrid"):
                    sink.notes.append("fsdp: hybrid_shard shards inside dp_shard_size ranks; set dp_replicate_size")
            elif word == "offload":
                sink.set("sharding.offload", "cpu", "fsdp: offload")
            elif word != "auto_wrap":  # auto_wrap: meshkit wraps each repeated block, always
                raise ImportingError(f"fsdp: '{word}' is not an FSDP option (full_shard, shard_grad_op, offload, ...)")
        return
    if not isinstance(value, dict):
        raise ImportingError("fsdp_config must be a mapping of FSDP settings")
    block = {key if key.startswith("fsdp_") else f"fsdp_{key}": item for key, item in value.items()}
    read_fsdp_config(block, sink, machines=1)
    sink.skipped_note("fsdp_config")


def wandb(name: str, value: Any, sink: Sink) -> None:
    if value in (False, "false", "False"):
        return
    sink.trackers.append("wandb")
    if name == "wandb_project":
        sink.recipe["wandb_project"] = str(value)


def tensorboard(name: str, value: Any, sink: Sink) -> None:
    if value not in (False, "false", "False"):
        sink.trackers.append("tensorboard")


def ray(name: str, value: Any, sink: Sink) -> None:
    """use_ray, ray_num_workers, resources_per_worker ({GPU: 1, CPU: 4}): meshkit's Ray launch backend."""
    if name == "use_ray":
        if value in (True, "true", "True"):
            sink.set("launch.backend", "ray", name)
    elif name == "ray_num_workers":
        sink.set("launch.ray_num_workers", int(value), name)
    elif name == "resources_per_worker":
        if not isinstance(value, dict):
            raise ImportingError(f"resources_per_worker: {value!r}: give a mapping such as {{GPU: 1, CPU: 4}}")
        for resource, key in (("CPU", "launch.ray_cpus_per_worker"), ("GPU", "launch.ray_gpus_per_worker")):
            if resource in value:
                sink.set(key, float(value[resource]), f"{name}.{resource}")
        for other in sorted(set(value) - {"CPU", "GPU"}):
            sink.skip(f"{name}.{other}", "meshkit reserves CPUs and GPUs per rank")
        sink.skipped_note(name)


def checkpointing_kwargs(name: str, value: Any, sink: Sink) -> None:
    if isinstance(value, dict) and value.get("use_reentrant") in (True, "true", "True"):
        sink.notes.append(f"{name}: use_reentrant: true — meshkit checkpoints non-reentrant (the same gradients)")
