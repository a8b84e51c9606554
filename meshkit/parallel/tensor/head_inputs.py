"""Per-head inputs that a model computes outside its attention and hands in (Bloom's ALiBi bias, one row per batch
row and head; MPT's, one row per head; a per-head 4-D attention bias): under tensor parallel each rank's attention
holds some of the heads, so it takes their rows only. Recognised by shape against the attention's head count, not
by argument name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _TakeOwnHeads:
    """A forward pre-hook: in each tensor keyword argument laid out per head, keep this rank's heads."""

    def __init__(self, heads: int, rank: int, ranks: int) -> None:
        self.heads, self.local = heads, heads // ranks
        self.start = rank * self.local

    def _own(self, value: torch.Tensor, batch: int) -> torch.Tensor:
        rows = slice(self.start, self.start + self.local)
        if value.dim() == 3 and value.shape[0] == batch * self.heads:  # [batch × heads, 1 or q, k] (ALiBi)
            return value.unflatten(0, (batch, self.heads))[:, rows].flatten(0, 1)
        if value.dim() == 3 and value.shape[0] == self.heads and value.shape[1] == 1:  # [heads, 1, k] (MPT's ALiBi)
            return value[rows]
        if value.dim() == 4 and value.shape[0] == batch and value.shape[1] == self.heads:  # [batch, heads, q, k]
            return value[:, rows]
        return value

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            return None
        batch = hidden.shape[0]

        def own(value: Any) -> Any:  # (a tensor shaped like the hidden states is one: Bloom's residual)
            per_head = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape != hidden.shape
            return self._own(value, batch) if per_head else value

        rest = tuple(own(value) for value in args[1:])  # (CTRL hands its mask in after q, k and v)
        mine = {key: own(value) for key, value in kwargs.items() if key != "hidden_states"}
        return (*args[:1], *rest), {**kwargs, **mine}


def take_own_heads(attention: nn.Module, heads: int, rank: int, ranks: int) -> None:
    """Hand `attention` (split over `ranks` tp ranks, this one `rank`) only its heads' rows of per-head inputs."""
    if heads > 1:
        attention.register_forward_pre_hook(_TakeOwnHeads(heads, rank, ranks), with_kwargs=True)
