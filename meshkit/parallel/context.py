"""Context parallel: the sequence split over `cp` ranks, attention computed by ring attention.

Every rank of a cp group sees the same samples and keeps 2 of the 2·cp sequence chunks (chunks i and
2·cp−1−i, balanced under a causal mask). RoPE positions are the tokens' true offsets in the full sequence. The
loss on each rank is the mean over its tokens, so averaging gradients over the dp × cp ranks gives the mean
over the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkit.errors import MeshkitError
from meshkit.parallel.blocks import find_blocks
from meshkit.parallel.ring_attention import chunk_ids, ring_attention


class ContextParallelError(MeshkitError):
    """A sequence or model context parallel cannot split; the message says what to change."""


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `tensor` along `dim` (the sequence), concatenated."""
    if tensor.shape[dim] % (2 * cp):
        raise ContextParallelError(
            f"sequence length {tensor.shape[dim]} is not divisible by 2·cp = {2 * cp}: "
            f"choose a sequence length divisible by {2 * cp}, or a smaller cp"
        )
    chunks = tensor.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(rank, cp)
    return torch.cat((chunks[first], chunks[second]), dim=dim)


def local_positions(local_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """True offsets, in the full sequence, of this rank's local tokens."""
    half = local_len // 2
    first, second = chunk_ids(rank, cp)
    return torch.cat(
        (
            torch.arange(first * half, (first + 1) * half, device=device),
            torch.arange(second * half, (second + 1) * half, device=device),
        )
    )


class _RingAttend:
    """Replaces an attention module's `attend(q, k, v)` (causal SDPA) with ring attention over `group`."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, causal=True)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, blocks_path: str | None = None) -> None:
    """Swap every block's attention for ring attention and feed the model its true token positions.

    The model must route attention through an `attend(q, k, v)` method on its attention modules (the
    reference GPT does) and accept `positions=` in forward.
    """
    _, blocks = find_blocks(model, blocks_path)
    attends = [m for block in blocks for m in block.modules() if callable(getattr(m, "attend", None))]
    if not attends:
        raise ContextParallelError(
            f"{type(model).__name__} has no attention module with an attend(q, k, v) method: context parallel "
            "swaps that method for ring attention"
        )
    for module in attends:
        module.attend = _RingAttend(group)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    forward: Callable[..., Any] = model.forward

    def forward_with_positions(tokens: torch.Tensor, positions: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if positions is None:
            positions = local_positions(tokens.shape[1], cp, rank, tokens.device)
        return forward(tokens, positions=positions, **kwargs)

    model.forward = forward_with_positions  # type: ignore[method-assign]
