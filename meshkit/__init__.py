"""meshkit: train PyTorch models on many processes, devices and machines with any parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshkit.config import RunConfig
from meshkit.core.import_noise import drop_import_noise

drop_import_noise()

if TYPE_CHECKING:
    from meshkit.compat.accelerate.accelerator import Accelerator
    from meshkit.compat.accelerate.handlers import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DeepSpeedPlugin,
        DistributedDataParallelKwargs,
        DistributedType,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ParallelismConfig,
        ProfileKwargs,
        ProjectConfiguration,
    )
    from meshkit.compat.accelerate.memory import find_executable_batch_size
    from meshkit.engine import Engine

# Accelerate's names, for scripts ported by changing the import (meshkit.compat.accelerate.handlers)
_ACCELERATE_RECORDS = (
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DDPCommunicationHookType",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "ProfileKwargs",
    "ProjectConfiguration",
)

__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "Engine",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RunConfig",
    "find_executable_batch_size",
    "set_seed",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # `meshkit.Engine` and `set_seed` are imported on first use: the command line (estimate, plan, config) starts
    # without torch and the engine's distributed imports, which take seconds.
    if name == "set_seed":
        from meshkit.core.seed import set_seed

        return set_seed
    if name == "Engine":
        from meshkit.engine import Engine

        return Engine
    if name == "Accelerator":
        from meshkit.compat.accelerate.accelerator import Accelerator

        return Accelerator
    if name in _ACCELERATE_RECORDS:
        from meshkit.compat.accelerate import handlers

        return getattr(handlers, name)
    if name == "find_executable_batch_size":
        from meshkit.compat.accelerate.memory import find_executable_batch_size

        return find_executable_batch_size
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")
