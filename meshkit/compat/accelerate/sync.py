"""When gradients are reduced, decided by the block a backward runs in (Accelerate's `no_sync` and
`trigger_sync_in_backward`), and sequence chunks held in place for a block (`maybe_context_parallel`).

meshkit decides syncing per micro-step (`GradientState.sync`): DDP's `no_sync`, FSDP's
`set_requires_gradient_sync` and ZeRO-1/2's end-of-window reduction all follow it. Holding the flag for a block
and setting each prepared model's own switch the same way gives Accelerate's behaviour in every layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from meshkit.engine.context import EngineContext
from meshkit.parallel.context.apply import shard_sequence


class SyncControl:
    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    @contextlib.contextmanager
    def hold(self, model: nn.Module, sync: bool) -> Iterator[None]:
        """Inside the block every backward reduces (`sync`) or accumulates locally (not `sync`)."""
        state = self.ctx.gradient_state
        saved = state.sync
        state.sync = sync
        models = [m for m in self.ctx.objects.models if m is model] or list(self.ctx.objects.models)
        restore = [_switch(m, sync) for m in models]
        try:
            yield
        finally:
            for undo in restore:
                undo()
            state.sync = saved

    @contextlib.contextmanager
    def sequence_chunks(self, buffers: list[torch.Tensor], dims: list[int], keep: Any) -> Iterator[None]:
        """Each buffer holds this rank's chunks of its sequence dim inside the block (as `shard_sequence`)."""
        if len(dims) != len(buffers):
            raise ValueError("maybe_context_parallel: give one buffer_seq_dims entry per buffer")
        mesh = self.ctx.mesh
        cp, index = mesh.size("cp"), mesh.coordinate("cp")
        whole = []
        for buffer, dim in zip(buffers, dims, strict=True):
            whole.append(buffer.data)
            buffer.data = shard_sequence(buffer.data, cp, index, dim)
        try:
            yield
        finally:
            for buffer, data in zip(buffers, whole, strict=True):
                if not any(buffer is kept for kept in keep):
                    buffer.data = data


def _switch(model: Any, sync: bool) -> Any:
    """Set a prepared model's own reduce switch; returns how to put it back."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP
        model.set_requires_gradient_sync(sync)
        return lambda: None  # (the next accumulate() sets it again for its micro-step)
    if hasattr(model, "require_backward_grad_sync"):  # DDP
        before = model.require_backward_grad_sync
        model.require_backward_grad_sync = sync
        if sync and hasattr(model, "reducer"):
            model.reducer.prepare_for_backward([])  # (the forward ran with syncing off: arm the reducer)

        def undo() -> None:
            model.require_backward_grad_sync = before

        return undo
    return lambda: None
