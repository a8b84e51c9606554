"""meshkit: train PyTorch models on many processes, devices and machines with any parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshkit.config import RunConfig
from meshkit.seed import set_seed

if TYPE_CHECKING:
    from meshkit.accelerator import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs
    from meshkit.engine import Engine

__all__ = [
    "Accelerator",
    "DistributedDataParallelKwargs",
    "Engine",
    "InitProcessGroupKwargs",
    "RunConfig",
    "set_seed",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # `meshkit.Engine` is imported on first use: the command line (estimate, plan, config) starts without the
    # engine's distributed imports, which take seconds.
    if name == "Engine":
        from meshkit.engine import Engine

        return Engine
    if name in ("Accelerator", "DistributedDataParallelKwargs", "InitProcessGroupKwargs"):
        from meshkit import accelerator

        return getattr(accelerator, name)
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")
