"""meshkit: train PyTorch models on many processes, devices and machines with any parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshkit.config import RunConfig
from meshkit.core.moved_modules import install_moved_module_finder

if TYPE_CHECKING:
    from meshkit.engine import Engine
    from meshkit.engine.accelerate.accelerator import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

__all__ = [
    "Accelerator",
    "DistributedDataParallelKwargs",
    "Engine",
    "InitProcessGroupKwargs",
    "RunConfig",
    "set_seed",
]
__version__ = "0.1.0"

install_moved_module_finder()


def __getattr__(name: str) -> Any:
    # `meshkit.Engine` and `set_seed` are imported on first use: the command line (estimate, plan, config) starts
    # without torch and the engine's distributed imports, which take seconds.
    if name == "set_seed":
        from meshkit.core.seed import set_seed

        return set_seed
    if name == "Engine":
        from meshkit.engine import Engine

        return Engine
    if name in ("Accelerator", "DistributedDataParallelKwargs", "InitProcessGroupKwargs"):
        from meshkit.engine.accelerate import accelerator

        return getattr(accelerator, name)
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")
