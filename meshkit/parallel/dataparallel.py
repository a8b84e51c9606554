"""Classic single-process data parallel (`strategy: dataparallel`): `torch.nn.DataParallel` over this process's
local accelerators.

One process scatters each batch over its GPUs, replicates the model on every forward and gathers the outputs
and gradients on the first GPU — simple, but the first GPU and the Python thread of the one process bound its
speed, which is why DDP (one process per device, the default) is faster on more than one device. On a host with
one or no accelerator there is nothing to spread over: the model runs as one process, and meshkit says so.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from meshkit.core.errors import MeshkitError


class WrappedModelWarning(UserWarning):
    """prepare() got a model inside nn.DataParallel or DDP; meshkit unwrapped it."""


class DataParallelError(MeshkitError):
    """strategy=dataparallel asked for where it cannot run; the message says what to use instead."""


def dataparallel_devices(device: torch.device) -> list[int]:
    """The accelerator indices DataParallel spreads over (all of this host's for the device type), or [] when there
    are fewer than two."""
    if device.type == "cpu":
        return []
    module = getattr(torch, device.type, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else 0
    return list(range(count)) if count > 1 else []


def check_world(world_size: int) -> None:
    if world_size > 1:
        raise DataParallelError(
            f"strategy=dataparallel runs in one process over its local devices, but this job has {world_size} "
            "processes: launch one process (nproc_per_node=1), or drop strategy to use DDP (one process per device)"
        )


def apply_dataparallel(model: nn.Module, device: torch.device) -> tuple[nn.Module, str | None]:
    """(`model` wrapped in nn.DataParallel over the local accelerators, None), or (`model`, the one line saying
    why it runs as one process without it)."""
    devices = dataparallel_devices(device)
    if not devices:
        kind = "no accelerator" if device.type == "cpu" else f"one {device.type} device"
        return model, (
            f"meshkit: strategy=dataparallel on a host with {kind}: nothing to spread over, running as one process "
            "(DataParallel needs two or more GPUs in this process)"
        )
    return nn.DataParallel(model, device_ids=devices, output_device=devices[0]), None


def bare_module(model: nn.Module, strategy: str) -> nn.Module:
    """The module inside a user's nn.DataParallel or DDP wrapper (meshkit applies the run's own layout); a warning
    says so, except for nn.DataParallel under strategy=dataparallel, which asked for just that."""
    if not isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return model
    if not (strategy == "dataparallel" and isinstance(model, nn.DataParallel)):
        warnings.warn(
            f"prepare() got a model wrapped in {type(model).__name__}: meshkit unwraps it and applies the "
            "run's own layout (pass the bare module to silence this)",
            WrappedModelWarning,
            stacklevel=4,
        )
    return model.module
