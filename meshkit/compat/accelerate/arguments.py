"""`accelerate.Accelerator`'s constructor arguments as meshkit code arguments (the highest precedence, as in
Accelerate), plus what the `Accelerator` keeps to answer Accelerate's attributes.

Plugins and handlers are read by their fields, so Accelerate's own objects work as well as meshkit's records. The
FSDP and DeepSpeed plugins go through the same readers as `meshkit config import` (one mapping, not two).
An argument that changes nothing here gives one notice line; one that names a feature meshkit lacks is refused in
one line naming what to do instead.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshkit.compat.accelerate.handlers import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    enum_value,
)
from meshkit.config.importing.accelerate import read_deepspeed_block, read_fsdp_config
from meshkit.config.importing.deepspeed import read_deepspeed
from meshkit.config.importing.result import Imported
from meshkit.config.yaml_text import load_yaml
from meshkit.core.errors import MeshkitError


class AcceleratorError(MeshkitError):
    """An Accelerator argument meshkit does not take; the message says what to use."""


_TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "all": None}
_DDP_FIELDS = (
    "bucket_cap_mb",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "broadcast_buffers",
)
_DEEPSPEED_DEFAULTS = {"hf_ds_config", "is_train_batch_min"}  # (no meshkit setting: the batch is the script's)
_FP8 = ("FP8RecipeKwargs", "TERecipeKwargs", "AORecipeKwargs", "MSAMPRecipeKwargs")


@dataclass
class AcceleratorSettings:
    """What an `Accelerator` was built with, beyond the meshkit config: its handlers and configurations."""

    dataloader_config: Any = field(default_factory=DataLoaderConfiguration)
    project_configuration: Any = field(default_factory=ProjectConfiguration)
    gradient_accumulation_plugin: Any = None
    init_handler: Any = None
    ddp_handler: Any = None
    profile_handler: Any = None
    autocast_handler: Any = None
    scaler_handler: Any = None
    deepspeed_plugin: Any = None
    fsdp_plugin: Any = None
    step_scheduler_with_optimizer: bool = True
    device_placement: bool = True
    rng_types: list[str] = field(default_factory=lambda: ["generator"])
    log_with: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


def accelerate_arguments(  # noqa: C901 - one branch per argument, read in Accelerate's order
    *,
    device_placement: bool = True,
    split_batches: bool | None = None,
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int = 1,
    cpu: bool = False,
    dataloader_config: Any = None,
    deepspeed_plugin: Any = None,
    fsdp_plugin: Any = None,
    torch_tp_plugin: Any = None,
    megatron_lm_plugin: Any = None,
    rng_types: list[Any] | None = None,
    log_with: Any = None,
    project_dir: str | None = None,
    project_config: Any = None,
    gradient_accumulation_plugin: Any = None,
    step_scheduler_with_optimizer: bool = True,
    kwargs_handlers: list[Any] | None = None,
    dynamo_backend: Any = None,
    dynamo_plugin: Any = None,
    deepspeed_plugins: Any = None,
    parallelism_config: Any = None,
) -> tuple[dict[str, Any], AcceleratorSettings]:
    """(meshkit code arguments, the settings the Accelerator keeps) for Accelerate's constructor arguments."""
    out: dict[str, Any] = {}
    kept = AcceleratorSettings(step_scheduler_with_optimizer=step_scheduler_with_optimizer)
    kept.device_placement = device_placement
    if megatron_lm_plugin is not None:
        raise AcceleratorError(
            "megatron_lm_plugin: meshkit splits the model itself; pass parallelism_config=ParallelismConfig(tp_size=, "
            "...) or Engine(tp=, pp=) instead"
        )
    if mixed_precision is not None:
        precision = enum_value(mixed_precision)
        if precision == "fp8":
            raise AcceleratorError("mixed_precision='fp8' is not supported: use 'bf16'")
        out["precision"] = precision
    if gradient_accumulation_plugin is not None:
        kept.gradient_accumulation_plugin = gradient_accumulation_plugin
        gradient_accumulation_steps = getattr(gradient_accumulation_plugin, "num_steps", None) or 1
        if getattr(gradient_accumulation_plugin, "sync_each_batch", False):
            kept.notices.append(
                "GradientAccumulationPlugin(sync_each_batch=True): meshkit reduces once per window (the same sums)"
            )
    else:
        kept.gradient_accumulation_plugin = GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
    if gradient_accumulation_steps != 1:
        out["grad_accum_steps"] = gradient_accumulation_steps
    if cpu:
        out["device"] = "cpu"
    kept.dataloader_config = dataloader_config or DataLoaderConfiguration()
    if split_batches is not None:
        kept.dataloader_config.split_batches = split_batches
    _dataloader_notices(kept.dataloader_config, kept.notices)
    if rng_types is not None:
        kept.rng_types = [enum_value(kind) for kind in rng_types]
    _trackers(log_with, out, kept)
    kept.project_configuration = project_config or ProjectConfiguration()
    if project_dir is not None:
        kept.project_configuration.set_directories(str(project_dir))
    logging_dir = kept.project_configuration.logging_dir or kept.project_configuration.project_dir
    if logging_dir is not None:
        out.setdefault("logging", {})["dir"] = str(logging_dir)
    _compile(dynamo_backend, dynamo_plugin, out)
    for handler in kwargs_handlers or []:
        _handler(handler, out, kept)
    if deepspeed_plugin is None and deepspeed_plugins is not None:
        plugins = deepspeed_plugins if isinstance(deepspeed_plugins, dict) else {"default": deepspeed_plugins}
        deepspeed_plugin = next(iter(plugins.values()))
    for plugin, reader in ((deepspeed_plugin, _deepspeed), (fsdp_plugin, _fsdp)):
        if plugin is not None:
            imported = Imported()
            reader(plugin, imported)
            _merge(imported, out, kept.notices)
    kept.deepspeed_plugin, kept.fsdp_plugin = deepspeed_plugin, fsdp_plugin
    if torch_tp_plugin is not None:
        out.setdefault("parallel", {})["tp"] = int(torch_tp_plugin.tp_size)
    if parallelism_config is not None:
        _parallelism(parallelism_config, out)
    return out, kept


def _dataloader_notices(config: Any, notices: list[str]) -> None:
    if getattr(config, "dispatch_batches", None):
        notices.append("dispatch_batches: every rank reads its own share of the data (the same batches)")
    if getattr(config, "non_blocking", False):
        notices.append("non_blocking: meshkit copies batches to the device itself")
    if getattr(config, "data_seed", None) is not None:
        notices.append("data_seed: the shuffle order follows the run's seed (Engine(seed=...))")


def _trackers(log_with: Any, out: dict[str, Any], kept: AcceleratorSettings) -> None:
    trackers = [log_with] if isinstance(log_with, str) or not isinstance(log_with, (list, tuple)) else list(log_with)
    names = []
    for tracker in (t for t in trackers if t is not None):
        name = enum_value(tracker)
        if name not in _TRACKERS:
            raise AcceleratorError(f"log_with={name!r}: meshkit's trackers are jsonl, tensorboard and wandb")
        names += ["tensorboard", "wandb"] if name == "all" else [name]
    if names:
        kept.log_with = list(dict.fromkeys(names))
        out["logging"] = {"trackers": ["jsonl", *kept.log_with]}


def _compile(dynamo_backend: Any, dynamo_plugin: Any, out: dict[str, Any]) -> None:
    backend = dynamo_backend or getattr(dynamo_plugin, "backend", None)
    backend_name = enum_value(backend or "no")
    if backend_name != "no" and not getattr(dynamo_plugin, "disable", False):
        compile_settings: dict[str, Any] = {"enabled": True, "backend": backend_name}
        for name in ("mode", "fullgraph", "dynamic"):
            value = getattr(dynamo_plugin, name, None)
            if value is not None:
                compile_settings[name] = value
        out["compile"] = compile_settings


def _handler(handler: Any, out: dict[str, Any], kept: AcceleratorSettings) -> None:
    kind = type(handler).__name__
    if kind in _FP8:
        raise AcceleratorError(f"kwargs_handlers: {kind} (fp8 training) is not supported: use mixed_precision='bf16'")
    if hasattr(handler, "static_graph") and hasattr(handler, "find_unused_parameters"):
        kept.ddp_handler = handler
        ddp = {name: getattr(handler, name) for name in _DDP_FIELDS if hasattr(handler, name)}
        hook, wrapper = (
            enum_value(getattr(handler, "comm_hook", "no")),
            enum_value(getattr(handler, "comm_wrapper", "no")),
        )
        if hook != "no":
            ddp["comm_hook"] = hook
            ddp["comm_wrapper"] = "none" if wrapper == "no" else wrapper
            ddp["comm_state"] = dict(getattr(handler, "comm_state_option", None) or {})
        out["ddp"] = ddp
    elif hasattr(handler, "timeout") and hasattr(handler, "init_method"):
        kept.init_handler = handler
        if handler.timeout is not None:
            out["collective_timeout_s"] = handler.timeout.total_seconds()
    elif hasattr(handler, "schedule_option") and hasattr(handler, "output_trace_dir"):
        kept.profile_handler = handler
    elif hasattr(handler, "growth_interval") and hasattr(handler, "init_scale"):
        kept.scaler_handler = handler
    elif hasattr(handler, "cache_enabled") and hasattr(handler, "enabled"):
        kept.autocast_handler = handler
    else:
        raise AcceleratorError(
            f"kwargs_handlers: {kind} is not taken (meshkit takes InitProcessGroupKwargs, DistributedDataParallelKwargs"
            ", ProfileKwargs, AutocastKwargs and GradScalerKwargs)"
        )


def _deepspeed(plugin: Any, imported: Imported) -> None:
    """Its `hf_ds_config` as `meshkit config import` reads a ds_config.json; else its fields, as the
    `deepspeed_config` block of an Accelerate config (the same reader)."""
    config = getattr(plugin, "hf_ds_config", None)
    config = getattr(config, "config", config)  # Accelerate wraps it in an HfDeepSpeedConfig
    if isinstance(config, (str, Path)):
        text = Path(config).read_text()
        config = json.loads(text) if str(config).endswith(".json") else load_yaml(text)
    if config:
        read_deepspeed(dict(config), imported, prefix="deepspeed_plugin.hf_ds_config: ")
        return
    block = {
        name: enum_value(value) if name.endswith("_device") else value
        for name, value in ((f.name, getattr(plugin, f.name)) for f in dataclasses.fields(plugin))
        if value is not None and name not in _DEEPSPEED_DEFAULTS
    }
    read_deepspeed_block(block, imported, lambda name, world: None, world=1)


def _fsdp(plugin: Any, imported: Imported) -> None:
    offload = getattr(plugin, "cpu_offload", None)
    block = {
        "fsdp_sharding_strategy": enum_value(getattr(plugin, "sharding_strategy", None) or "FULL_SHARD").upper(),
        "fsdp_offload_params": bool(getattr(offload, "offload_params", offload)),
        "fsdp_activation_checkpointing": bool(getattr(plugin, "activation_checkpointing", False)),
        "fsdp_forward_prefetch": bool(getattr(plugin, "forward_prefetch", False)),
    }
    block["fsdp_sharding_strategy"] = str(block["fsdp_sharding_strategy"]).split(".")[-1]
    if getattr(plugin, "reshard_after_forward", None) is not None:
        block["fsdp_reshard_after_forward"] = plugin.reshard_after_forward
    read_fsdp_config(block, imported, machines=1)


def _merge(imported: Imported, out: dict[str, Any], notices: list[str]) -> None:
    """Dotted meshkit keys into the nested code arguments; what was not taken, one notice line each."""
    for dotted, value in imported.values.items():
        *sections, key = dotted.split(".")
        target = out
        for section in sections:
            target = target.setdefault(section, {})
        target[key] = value
    notices.extend(f"{origin}: {why}" for origin, why in imported.skipped)


def _parallelism(config: Any, out: dict[str, Any]) -> None:
    """ParallelismConfig's sizes as meshkit's mesh; sharded data parallel (dp_shard > 1) is ZeRO-3, as in Accelerate."""
    if (getattr(config, "sp_size", 1) or 1) > 1:
        raise AcceleratorError(
            "parallelism_config.sp_size (DeepSpeed Ulysses): meshkit's sequence split is context parallel; set cp_size"
        )
    parallel = out.setdefault("parallel", {})
    for name, dim in (
        ("dp_replicate_size", "dp_replicate"),
        ("dp_shard_size", "dp_shard"),
        ("tp_size", "tp"),
        ("cp_size", "cp"),
    ):
        size = getattr(config, name, None)
        if size is not None:
            parallel[dim] = int(size)
    if (getattr(config, "dp_shard_size", 1) or 1) > 1:
        out.setdefault("sharding", {}).setdefault("zero_stage", 3)
