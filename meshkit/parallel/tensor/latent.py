"""Tensor parallel for latent attention (DeepSeek-V2/V3's MLA).

The low-rank projections (`q_a_proj`, `kv_a_proj_with_mqa`) and their norms stay whole on every tp rank; the
per-head projections from them (`q_b_proj`, `kv_b_proj`) are split by heads, `o_proj` by rows. Column-parallel
layers sum their input gradients over tp, so the latent K/V reaches backward whole — except the rotary key at the
end of `kv_a_proj_with_mqa`'s output, which every head uses directly: each rank holds its own heads' part of its
gradient. Summing that slice over tp makes every gradient before it (the projection's weights, the attention's
input) whole and equal on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkit.models.facts import AttentionFacts


class _SumTrailingGradient(torch.autograd.Function):
    """Identity forward; backward sums the last `width` features of the gradient over `group`."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, width: int, group: Any) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        tail = grad[..., -ctx.width :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.width :] = tail
        return grad, None, None


def sum_shared_rotary_key(model: nn.Module, attention: tuple[AttentionFacts, ...], group: Any) -> set[str]:
    """Hook every latent attention of `model` (those on this pipeline stage); returns their module names, whose
    parameters left whole have whole gradients (nothing to sum after backward)."""
    hooked = set()
    for facts in attention:
        if facts.latent is None:
            continue
        try:
            projection = model.get_submodule(f"{facts.path}.{facts.latent}")
        except AttributeError:  # the block lives on another pipeline stage
            continue
        width = facts.rotary_width
        projection.register_forward_hook(lambda _m, _i, out, w=width: _SumTrailingGradient.apply(out, w, group))
        hooked.add(facts.path)
    return hooked
