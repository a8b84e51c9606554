"""How tensor parallel stores a fused weight — the one owner of that layout.

A fused projection stacks its parts along one dim: q, k and v (GPT-2's `c_attn`, Phi-3's `qkv_proj`, unequal
under GQA) or gate and up. A contiguous split over the tp ranks would hand rank 0 all of q, so tensor parallel
keeps such a weight *interleaved*: [q0 k0 v0 | q1 k1 v1 | ...], each rank's share of every part side by side,
and a contiguous split then gives each rank its heads of q, k and v. Files hold the canonical order [q | k | v].
Every reader and writer of full tensors (checkpoints, exports, loading a pretrained file, the engine's full state
dict) goes through `SplitWeights` to and from that canonical order; nothing else knows the interleaving.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from meshkit.parallel.tensor.auto import is_transposed_linear


@dataclass(frozen=True)
class FusedParts:
    """The dim a fused weight stacks its parts on, and each part's size along it. `groups` > 1: the rows are
    [groups × [q | v | k ...]], each group holding its share of the heads (CodeGen's four model-parallel shards,
    `unit` = the head size): each rank keeps that many groups, with its heads in each."""

    dim: int
    parts: tuple[int, ...]
    groups: int = 1
    unit: int = 0

    def interleave(self, full: torch.Tensor, tp: int) -> torch.Tensor:
        """[q; k; v] -> [q0 k0 v0; q1 k1 v1; ...] on a full tensor."""
        if self.groups > 1:
            return full.index_select(self.dim, self._grouped_order(tp).to(full.device))
        pieces = [part.chunk(tp, dim=self.dim) for part in full.split(list(self.parts), dim=self.dim)]
        return torch.cat([piece[rank] for rank in range(tp) for piece in pieces], dim=self.dim)

    def _grouped_order(self, tp: int) -> torch.Tensor:
        """Storage row -> canonical row for grouped parts: rank r holds the heads r·H/tp .. (r+1)·H/tp - 1 (in the
        model's head order: group after group), laid out as the model's code cuts a rank's share (the same number
        of groups, each with 1/tp of its heads)."""
        groups, kinds, width = self.groups, len(self.parts), self.parts[0] // self.groups
        rows = torch.arange(sum(self.parts)).view(groups, kinds, width // self.unit, self.unit)
        heads = rows.permute(0, 2, 1, 3).reshape(-1, kinds, self.unit)  # head-major: head h = g·Hg + i
        share = heads.shape[0] // tp
        ranks = [heads[rank * share : (rank + 1) * share].view(groups, -1, kinds, self.unit) for rank in range(tp)]
        return torch.cat([rank.permute(0, 2, 1, 3).reshape(-1) for rank in ranks])

    def restore(self, stored: torch.Tensor, tp: int) -> torch.Tensor:
        """The inverse: a full tensor in storage order back to [q; k; v]."""
        if self.groups > 1:
            return stored.index_select(self.dim, self._grouped_order(tp).argsort().to(stored.device))
        shares = [part // tp for part in self.parts]
        ranks = [rank.split(shares, dim=self.dim) for rank in stored.chunk(tp, dim=self.dim)]
        return torch.cat([ranks[rank][index] for index in range(len(self.parts)) for rank in range(tp)], dim=self.dim)


@dataclass(frozen=True)
class SplitWeights:
    """The fused weights of one model (by parameter name) as tensor parallel over `tp` ranks stores them."""

    tp: int = 1
    fused: Mapping[str, FusedParts] = field(default_factory=dict)

    def __contains__(self, name: object) -> bool:
        return name in self.fused

    def __bool__(self) -> bool:
        return bool(self.fused)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.fused)

    def to_storage(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A full tensor in the canonical (file) order -> the order tensor parallel keeps; others unchanged."""
        parts = self.fused.get(name)
        return full if parts is None else parts.interleave(full, self.tp)

    def to_canonical(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A full (gathered) tensor in storage order -> the canonical order; others unchanged."""
        parts = self.fused.get(name)
        return full if parts is None else parts.restore(full, self.tp)

    def prefixed(self, prefix: str) -> SplitWeights:
        """The same weights named `prefix.name` (a checkpoint's `model.0.` names)."""
        return SplitWeights(self.tp, {f"{prefix}.{name}": parts for name, parts in self.fused.items()})

    @staticmethod
    def union(layouts: Iterable[SplitWeights], tp: int) -> SplitWeights:
        """Several layouts of one model (a pipeline's stages) as one."""
        return SplitWeights(tp, {name: parts for layout in layouts for name, parts in layout.fused.items()})


def fused_dim(module: nn.Module, param_name: str) -> int:
    """The dim along which a fused parameter stacks its parts (the output features)."""
    return 1 if is_transposed_linear(module) and param_name == "weight" else 0


def interleave_in_place(
    module: nn.Module, name: str, tp: int, parts: tuple[int, ...] | int = 3, groups: int = 1, unit: int = 0
) -> SplitWeights:
    """Store a fused layer's parameters interleaved, so a contiguous column split gives each rank its share of
    every part (its heads of q, k and v; its half of gate and up). `parts`: the parts' output sizes, or how many
    equal parts (3: q, k and v of GPT-2's c_attn; 2: gate and up); `groups`, `unit`: see `FusedParts`. A
    parameter still on the meta device is interleaved as its file's tensor streams in (`SplitWeights.to_storage`)."""
    fused: dict[str, FusedParts] = {}
    with torch.no_grad():
        for param_name, param in module.named_parameters(recurse=False):
            dim = fused_dim(module, param_name)
            sizes = parts if isinstance(parts, tuple) else (param.shape[dim] // parts,) * parts
            layout = FusedParts(dim, sizes, groups, unit)
            if not param.is_meta:
                param.copy_(layout.interleave(param, tp))
            fused[f"{name}.{param_name}"] = layout
    return SplitWeights(tp, fused)
