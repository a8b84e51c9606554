"""Mixed precision: autocast around the forward, fp32 outputs, and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkit.core.tree import map_tensors

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast for bf16/fp16; a no-op for full precision."""
    if precision not in AUTOCAST_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[precision])


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def autocast_forward(module: nn.Module, precision: str, device_type: str) -> None:
    """Run `module.forward` under autocast and hand back fp32 outputs, so the loss is computed in fp32."""
    if precision not in AUTOCAST_DTYPES:
        return
    forward: Callable[..., Any] = module.forward

    @functools.wraps(forward)
    def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
        with autocast_context(precision, device_type):
            out = forward(*args, **kwargs)
        return map_tensors(_upcast, out)

    module.forward = forward_in_autocast


def make_grad_scaler(
    precision: str, device: torch.device, sharded_over: dist.ProcessGroup | None = None, **settings: Any
) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling (its range is narrow); bf16 and fp32 do not. `settings`: GradScaler's own
    (init_scale, growth_factor, backoff_factor, growth_interval, enabled).

    With sharded gradients each rank sees only its shard, so the inf/nan check must be agreed over the group
    (`ShardedGradScaler`), or ranks would disagree on skipping the step.
    """
    if precision != "fp16":
        return None
    if sharded_over is not None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, process_group=sharded_over, **settings)
    return torch.amp.GradScaler(device.type, **settings)


def unscale_once(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Unscale `optimizer`'s gradients unless done already in this step (torch refuses a second unscale_ before
    update(): a loop may call unscale_gradients and then clip, as with Accelerate)."""
    from torch.amp.grad_scaler import OptState

    stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
    if stage is OptState.READY:
        scaler.unscale_(optimizer)
