"""Logging as Accelerate's scripts do it, with meshkit's process facts.

Scripts log through `accelerate.logging.get_logger(__name__)`, whose records need Accelerate's `PartialState`: the
Accelerator fills that state with this run's facts (`share_process_facts`: world size, rank, local rank, device,
the distributed type), so Accelerate's logger works under `meshkit.Accelerator` without Accelerate starting a
process group of its own. `get_logger` here is the same logger for scripts that import everything from meshkit:
`main_process_only=True` (the default) logs on rank 0 only, `in_order=True` on every rank in turn, and each message
is prefixed `[RANK r]` as Accelerate prefixes it."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch.distributed as dist

MESHKIT_MARK = "_meshkit_shared"  # (in Accelerate's shared state: filled by meshkit, so meshkit may refill it)


def share_process_facts(accelerator: Any) -> None:
    """Fill Accelerate's `PartialState` with this run's facts where Accelerate is installed and nothing else
    filled it (a `PartialState()` the user made keeps its own)."""
    try:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType as AccelerateType
    except ImportError:
        return
    shared = PartialState._shared_state  # (the underlying dict: changed in place, as Accelerate requires)
    if shared and not shared.get(MESHKIT_MARK):
        return
    shared.clear()
    shared.update({
        "_cpu": accelerator.device.type == "cpu",
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": accelerator.device,
        "debug": False,
        "distributed_type": AccelerateType(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "local_process_index": accelerator.local_process_index,
        "fork_launched": False,
        MESHKIT_MARK: True,
    })  # fmt: skip


def _rank() -> tuple[int, int]:
    """(this process's rank, the number of processes): from the process group, else the launcher's variables."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class MultiProcessAdapter(logging.LoggerAdapter):
    """Accelerate's multi-process logger: `main_process_only` (default True) and `in_order` keywords."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {_rank()[0]}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        rank, world = _rank()
        if not in_order:
            if not main_process_only or rank == 0:
                self.logger.log(level, msg, *args, **kwargs)
            return
        for turn in range(world):
            if turn == rank:
                self.logger.log(level, msg, *args, **kwargs)
            if world > 1 and dist.is_initialized():
                dist.barrier()

    @functools.lru_cache(None)  # noqa: B019 - once per message, as Accelerate's
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger for multi-process runs, as `accelerate.logging.get_logger`: `log_level` (else the
    `ACCELERATE_LOG_LEVEL` variable) sets its level."""
    level = log_level if log_level is not None else os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
