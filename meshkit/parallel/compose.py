"""The composition layer: apply the strategies of a run to a model, always in the same order.

Order (each step relies on the previous one's result): pipeline split -> tensor/sequence parallel -> context
parallel -> activation checkpointing -> compile -> FSDP or DDP. Compile comes before the data-parallel
wrapper so that DDP's bucket hooks see the compiled module, and before FSDP so sharding wraps compiled code.
"""

from __future__ import annotations

from torch import nn

from meshkit.config import RunConfig
from meshkit.mesh import ParallelMesh
from meshkit.parallel.compile import apply_compile
from meshkit.parallel.ddp import apply_ddp
from meshkit.precision import autocast_forward


def parallelize(model: nn.Module, mesh: ParallelMesh, config: RunConfig) -> nn.Module:
    """Place `model` on this rank's device and wrap it for the run's layout and precision."""
    model = model.to(mesh.device)
    model = apply_compile(model, config.compile)
    model = apply_ddp(model, mesh, config.ddp)
    autocast_forward(model, config.precision, mesh.device.type)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under the DDP and torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model
