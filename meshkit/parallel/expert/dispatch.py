"""Token routing for expert parallelism: dispatch every routed copy of a token to the rank holding its expert,
compute there, and combine the results back on the token's own rank (dropless: nothing is cut at a capacity).

The experts of an MoE block are dealt out in order: ep rank j holds experts [j·E/ep, (j+1)·E/ep). A rank sorts
its (token, expert) pairs by expert, so each destination's tokens are one contiguous piece, swaps piece sizes
with one small all-to-all, then the hidden states with a second (autograd carries the gradients back the same
way). What arrives is grouped by source rank, then by local expert. With a capacity factor, an expert takes at
most its share × the factor of each rank's copies (GShard's capacity, per source rank); the rest are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# (tokens [N, H], local expert of each [N, 1], weights [N, 1]) -> outputs [N, H]
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Route:
    """Where this rank's routed copies go, and what comes back to it."""

    order: torch.Tensor  # routed copies (token-major, top-k minor) sorted by expert
    source_token: torch.Tensor  # the token of each copy in `order`
    send: list[int]  # copies sent to each ep rank
    receive: list[int]  # copies received from each ep rank
    local_expert: torch.Tensor  # this rank's expert (0 .. E/ep - 1) of each received copy

    @classmethod
    def plan(
        cls, top_k_index: torch.Tensor, experts: int, group: dist.ProcessGroup, capacity_factor: float | None = None
    ) -> Route:
        """`capacity_factor`: each expert takes at most capacity_factor × (copies / experts) of this rank's
        copies, the earliest tokens first; the others are dropped (None: every copy is sent)."""
        ep = dist.get_world_size(group)
        local_experts = experts // ep
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] < experts]  # (a router's "no expert", index E, sends nothing)
        counts = torch.bincount(flat[order], minlength=experts)
        if capacity_factor is not None:
            capacity = math.ceil(capacity_factor * flat.numel() / experts)
            starts = torch.cumsum(counts, 0) - counts
            place = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(counts)
            order = order[place < capacity]  # (still sorted by expert, token order within each)
            counts = counts.clamp(max=capacity)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        local = torch.arange(local_experts, device=counts.device).repeat(ep)
        return cls(
            order=order,
            source_token=order // top_k_index.shape[-1],
            send=counts.view(ep, local_experts).sum(1).tolist(),
            receive=received.view(ep, local_experts).sum(1).tolist(),
            local_expert=torch.repeat_interleave(local, received),
        )


class _Exchange(torch.autograd.Function):
    """All-to-all of rows whose backward is the all-to-all the other way (torch's autograd-aware one is
    deprecated, its successor private)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = tensor.new_empty((sum(receive), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _Exchange.apply(grad, ctx.send, ctx.receive, ctx.group), None, None, None


def exchange(tensor: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of rows: `send[j]` rows go to rank j, `receive[j]` rows come from it (autograd-aware)."""
    return _Exchange.apply(tensor, receive, send, group)


def routed_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: int,
    group: dist.ProcessGroup,
    compute: ExpertCompute,
    capacity_factor: float | None = None,
) -> torch.Tensor:
    """The MoE output of `hidden` [T, H]: Σ over each token's top-k experts of weight × expert(token), with the
    experts spread over `group` and `compute` running this rank's share (dropped copies add nothing)."""
    route = Route.plan(top_k_index, experts, group, capacity_factor)
    arrived = exchange(hidden[route.source_token], route.receive, route.send, group)
    ones = top_k_weights.new_ones((arrived.shape[0], 1))
    computed = compute(arrived, route.local_expert.unsqueeze(1), ones)
    returned = exchange(computed, route.send, route.receive, group)
    weights = top_k_weights.reshape(-1)[route.order].unsqueeze(1)
    weighted = (returned * weights).to(hidden.dtype)
    return hidden.new_zeros(hidden.shape).index_add(0, route.source_token, weighted)
