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

from meshkit.core.errors import MeshkitError
from meshkit.models.blocks import find_blocks
from meshkit.models.hf_adapter import is_transformers_model
from meshkit.models.structure import ModelStructure
from meshkit.parallel.context.hf import use_ring_attention
from meshkit.parallel.context.ring_attention import ring_attention
from meshkit.parallel.context.visibility import chunk_ids


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


def _position_argument(model: nn.Module, structure: ModelStructure) -> str:
    """The forward argument that takes global positions; refuses a model context parallel cannot split."""
    if "cp" in structure.notes:
        raise ContextParallelError(f"context parallel cannot split this model: {structure.notes['cp']}")
    if structure.position_argument is None:
        raise ContextParallelError(
            f"context parallel must pass each token's position in the whole sequence, and "
            f"{type(model).__name__}.forward takes none that meshkit knows: name it in structure.position_argument"
        )
    return structure.position_argument


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, structure: ModelStructure) -> None:
    """Compute every attention with ring attention and feed the model its tokens' true positions.

    transformers models get ring attention through their attention-function registry (the model's own
    attention code calls it); other models route attention through an `attend(q, k, v)` method (the
    reference GPT does). Positions go in under the argument the model's forward reads; without one, refuse.
    """
    argument = _position_argument(model, structure)
    if is_transformers_model(model):
        use_ring_attention(model, group, [facts.path for facts in structure.attention])
    else:
        _, blocks = find_blocks(model, structure.blocks)
        attends = [m for block in blocks for m in block.modules() if callable(getattr(m, "attend", None))]
        if not attends:
            raise ContextParallelError(
                f"{type(model).__name__} has no attention module with an attend(q, k, v) method: context "
                "parallel swaps that method for ring attention"
            )
        for module in attends:
            setattr(module, "attend", _RingAttend(group))  # noqa: B010 - (a method, not a submodule)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    forward: Callable[..., Any] = model.forward

    def forward_with_positions(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            raise ContextParallelError(
                "under context parallel the model sees sequence chunks and cannot shift labels itself: pass "
                "engine.shard_sequence(batch) (it shifts them on the whole sequence first), call "
                "engine.train_step(batch), or pass loss_fn= to prepare()"
            )
        if kwargs.get(argument) is None:
            tokens = args[0] if args else kwargs.get("input_ids")
            if tokens is None:  # the first tensor argument gives the local sequence length
                tokens = next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            positions = local_positions(tokens.shape[1], cp, rank, tokens.device)
            # transformers models take position_ids [batch, seq] (a batch of 1 broadcasts); others [seq]
            kwargs[argument] = positions[None] if argument == "position_ids" else positions
        return forward(*args, **kwargs)

    model.forward = forward_with_positions
