"""Data parallel: every dp rank holds the whole model; gradients are averaged by bucketed all-reduce."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from meshkit.config.schema import DDPConfig
from meshkit.runtime.mesh import ParallelMesh

_DDP_PARAMETERS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


def apply_ddp(
    model: nn.Module, mesh: ParallelMesh, cfg: DDPConfig, ignored: tuple[nn.Module, ...] | list[nn.Module] = ()
) -> nn.Module:
    """Wrap in DDP over the gradient group (dp × cp); a single rank there has nothing to synchronise.
    The parameters of the `ignored` modules (expert banks split over ep) are left to their own reducer."""
    if mesh.grad_size == 1:
        return model
    if ignored:
        own = {id(param) for module in ignored for param in module.parameters()}
        names = [name for name, param in model.named_parameters() if id(param) in own]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    # torch >= 2.13 renamed broadcast_buffers to forward_sync_buffers (same meaning for True/False here).
    buffers_arg = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMETERS else "broadcast_buffers"
    buffers: dict[str, Any] = {buffers_arg: cfg.broadcast_buffers}
    wrapped = DistributedDataParallel(
        model,
        device_ids=[mesh.device.index] if mesh.device.type == "cuda" else None,
        process_group=mesh.grad_group,
        # Buckets fill in reverse order during backward and are all-reduced while backward goes on:
        # smaller buckets start communicating earlier, larger ones waste less per-call latency.
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
        **buffers,
    )
    register_comm_hook(wrapped, cfg)
    return wrapped


def register_comm_hook(model: DistributedDataParallel, cfg: DDPConfig) -> None:
    """torch's communication hook named by `ddp.comm_hook` (compressed or low-rank gradients), optionally wrapped
    to send fp16/bf16. PowerSGD keeps an error-feedback state per model, built from `ddp.comm_state`."""
    if cfg.comm_hook == "none":
        return
    hooks: dict[str, Any] = {
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
        "power_sgd": powerSGD_hook.powerSGD_hook,
        "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
    }
    hook = hooks[cfg.comm_hook]
    if cfg.comm_wrapper != "none":
        wrappers: dict[str, Any] = {
            "fp16": default_hooks.fp16_compress_wrapper,
            "bf16": default_hooks.bf16_compress_wrapper,
        }
        hook = wrappers[cfg.comm_wrapper](hook)
    low_rank = cfg.comm_hook in ("power_sgd", "batched_power_sgd")
    # (the compressing hooks take the process group as their state: None means DDP's own group)
    state = powerSGD_hook.PowerSGDState(model.process_group, **cfg.comm_state) if low_rank else model.process_group
    model.register_comm_hook(state, hook)
