"""Accelerate's configuration objects under their own names and fields, so a script that builds them runs with only
the import changed: `from meshkit import Accelerator, DataLoaderConfiguration, ProfileKwargs, ...`.

They are plain records: `accelerate_arguments` reads them by their fields (so Accelerate's own objects work just as
well) and turns them into meshkit settings; the `Accelerator` keeps them for the attributes that name them
(`accelerator.dataloader_config`, `accelerator.profile_handler`, ...).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


class DistributedType(str, enum.Enum):
    """Accelerate's names for the kind of run; equal to Accelerate's own members (both are the same strings)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class DDPCommunicationHookType(str, enum.Enum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class InitProcessGroupKwargs:
    backend: str | None = "nccl"  # (meshkit picks nccl on CUDA, gloo on CPU)
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass
class DistributedDataParallelKwargs:
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)


@dataclass
class AutocastKwargs:
    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradScalerKwargs:
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class ProfileKwargs:
    """`torch.profiler.profile`'s settings for `accelerator.profile()`; a trace per process is written to
    `output_trace_dir/profile_<process index>.json` when a directory is given."""

    activities: list[str] | None = None  # "cpu", "cuda", ...
    schedule_option: dict[str, int] | None = None  # torch.profiler.schedule(**schedule_option)
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None


@dataclass
class DataLoaderConfiguration:
    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@dataclass
class GradientAccumulationPlugin:
    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class FullyShardedDataParallelPlugin:
    """Read by its fields: sharding_strategy (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = 2, NO_SHARD = 0, HYBRID_SHARD),
    reshard_after_forward, cpu_offload, activation_checkpointing, forward_prefetch; the rest is meshkit's own."""

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: Any = None
    min_num_params: int | None = None


@dataclass
class DeepSpeedPlugin:
    """Read by its fields: a `hf_ds_config` (ds_config.json path or dict) as `meshkit config import` reads it, or
    zero_stage, offload devices and NVMe paths, gradient_accumulation_steps and gradient_clipping."""

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None


@dataclass
class ParallelismConfig:
    """The sizes of each parallel dimension, as Accelerate names them (dp_shard > 1 shards parameters: ZeRO-3)."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None

    def __post_init__(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            if getattr(self, name) is None:
                setattr(self, name, 1)

    def _size(self, name: str) -> int:
        return int(getattr(self, name) or 1)  # (None: 1, as Accelerate counts it)

    @property
    def dp_replicate_enabled(self) -> bool:
        return self._size("dp_replicate_size") > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self._size("dp_shard_size") > 1

    @property
    def tp_enabled(self) -> bool:
        return self._size("tp_size") > 1

    @property
    def cp_enabled(self) -> bool:
        return self._size("cp_size") > 1

    @property
    def sp_enabled(self) -> bool:
        return self._size("sp_size") > 1

    @property
    def total_size(self) -> int:
        sizes = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
        return math.prod(self._size(name) for name in sizes)


def enum_value(value: Any) -> str:
    """An enum member's value, or the value itself, as a lower-case string (Accelerate's and meshkit's enums)."""
    return str(getattr(value, "value", value)).lower()
