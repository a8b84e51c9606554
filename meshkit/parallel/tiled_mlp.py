"""Tiled MLP (Axolotl's `tiled_mlp`, from Arctic Long Sequence Training): a block's MLP runs over slices of the
sequence, each under torch's activation checkpointing, so that its intermediate activations ([tokens, several ×
hidden]) exist for one slice at a time, in the forward and (recomputed) in the backward. Only the slices' inputs
are kept. The gradients are the untiled MLP's: each token's MLP output depends on that token alone
(`models/token_wise.py` checks it), and every parameter's gradient is summed over the slices before it is
accumulated once (data-parallel hooks see one gradient per step, as usual).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MIN_SLICE_TOKENS = 1024


def apply_tiled_mlp(model: nn.Module, names: tuple[str, ...], shards: int | None = None) -> int:
    """Tile the MLPs named `names` that this module holds (a pipeline stage holds some); returns how many."""
    held = dict(model.named_modules())
    found = [held[name] for name in names if name in held and not getattr(held[name], "is_placeholder", False)]
    for mlp in found:
        tile_mlp(mlp, shards)
    return len(found)


def tile_mlp(mlp: nn.Module, shards: int | None = None) -> None:
    """Tile every call of `mlp`: `shards` slices of the sequence (None: slices of max(hidden, 1024) tokens — Arctic
    Long Sequence Training's ceil(seq / hidden), with slices never under 1024 tokens: a narrow model's would be
    too small to run fast, and their activations are small anyway).

    The whole call is tiled, the module's hooks included: sequence parallel's hooks then gather each slice from
    every rank's shard and hand back this rank's part of it, so the slices put together are this rank's shard."""
    call = type(mlp)._call_impl.__get__(mlp)  # (torch's own: forward with the module's hooks; tiled once only)

    def tiled(*args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else None
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or not torch.is_grad_enabled():
            return call(*args, **kwargs)
        args = args[1:]
        count = shards or math.ceil(hidden.shape[-2] / max(hidden.shape[-1], MIN_SLICE_TOKENS))
        count = max(1, min(count, hidden.shape[-2]))
        if count == 1:
            return call(hidden, *args, **kwargs)
        parts = [checkpoint(call, part, *args, use_reentrant=False, **kwargs) for part in hidden.chunk(count, -2)]
        return torch.cat(parts, dim=-2)

    mlp._call_impl = tiled  # type: ignore[method-assign]  # (an instance attribute: nn.Module.__call__ reads it)
