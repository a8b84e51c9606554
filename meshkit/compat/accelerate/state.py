"""What kind of run this is, in Accelerate's terms: `distributed_type`, `state`, `parallelism_config` and the
parallel ranks, read from meshkit's one mesh (nothing here keeps its own copy of a rank or a size)."""

from __future__ import annotations

from typing import Any

import torch

from meshkit.compat.accelerate.handlers import DistributedType, ParallelismConfig

Accelerator = Any  # (meshkit.compat.accelerate.accelerator.Accelerator, which imports this module)

_MULTI = {
    "cuda": DistributedType.MULTI_GPU,
    "cpu": DistributedType.MULTI_CPU,
    "xpu": DistributedType.MULTI_XPU,
    "npu": DistributedType.MULTI_NPU,
    "mlu": DistributedType.MULTI_MLU,
    "musa": DistributedType.MULTI_MUSA,
    "hpu": DistributedType.MULTI_HPU,
}


def distributed_type(world_size: int, device: torch.device, zero_stage: int) -> DistributedType:
    """NO for one process; FSDP when parameters are sharded (ZeRO-3 is FSDP2 here, as Accelerate's FSDP is);
    else MULTI_<device>. ZeRO-1/2 stay MULTI_*: Accelerate's DEEPSPEED branches call DeepSpeed's own engine."""
    if world_size == 1:
        return DistributedType.NO
    if zero_stage == 3:
        return DistributedType.FSDP
    return _MULTI.get(device.type, DistributedType.MULTI_GPU)


def parallelism_config(accelerator: Accelerator) -> ParallelismConfig:
    """The run's mesh sizes as Accelerate's ParallelismConfig (cp by meshkit's ring attention)."""
    mesh = accelerator.mesh
    return ParallelismConfig(
        dp_replicate_size=mesh.size("dp_replicate"),
        dp_shard_size=mesh.size("dp_shard"),
        tp_size=mesh.size("tp"),
        cp_size=mesh.size("cp"),
        cp_backend="torch",
    )


class AcceleratorState:
    """`accelerator.state`: the process and run facts Accelerate's `AcceleratorState` carries, answered by the
    Accelerator they belong to (no second source of truth)."""

    initialized = True

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        if name in _FROM_ACCELERATOR:
            return getattr(self._accelerator, name)
        raise AttributeError(
            f"accelerator.state.{name}: meshkit's state answers {', '.join(sorted(_FROM_ACCELERATOR))}; the rest of "
            "the run is in accelerator.config"
        )

    @property
    def backend(self) -> str:
        import torch.distributed as dist

        return dist.get_backend() if dist.is_initialized() else "gloo"

    @property
    def device_mesh(self) -> Any:
        return self._accelerator.torch_device_mesh

    @property
    def num_steps(self) -> int:
        return self._accelerator.gradient_accumulation_steps

    def __repr__(self) -> str:
        a = self._accelerator
        return (
            f"Distributed environment: {a.distributed_type.value}\nNum processes: {a.num_processes}\n"
            f"Process index: {a.process_index}\nLocal process index: {a.local_process_index}\nDevice: {a.device}\n"
            f"Mixed precision type: {a.mixed_precision}\n"
        )


_FROM_ACCELERATOR = {
    "num_processes",
    "process_index",
    "local_process_index",
    "device",
    "distributed_type",
    "mixed_precision",
    "is_main_process",
    "is_local_main_process",
    "is_last_process",
    "use_distributed",
    "deepspeed_plugin",
    "fsdp_plugin",
    "parallelism_config",
    "is_fsdp2",
    "split_between_processes",
    "wait_for_everyone",
    "main_process_first",
    "local_main_process_first",
    "on_main_process",
    "on_local_main_process",
    "on_last_process",
    "on_process",
    "on_local_process",
    "print",
}
