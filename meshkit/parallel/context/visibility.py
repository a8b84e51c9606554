"""Which keys each query of a ring-attention block may see, and which ring offsets any rank needs at all.

A query sees a key when the key is not in its future (causal), lies fewer than `window` positions back
(sliding-window attention, as transformers' masks define it: `kv_idx > q_idx - window`), and belongs to the same
sample of a packed row. Samples come from `position_ids`: a token at global index i with position p belongs to the
sample starting at i − p (positions restart at 0 with each packed sample; an unpacked row is one sample).

Each of the `cp` ranks holds chunks i and 2·cp−1−i of the 2·cp sequence chunks. A rank receives the keys and
values of the rank `offset` places before it; an offset whose blocks are all outside every rank's window is
never exchanged (a sliding window sends fewer blocks, not more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks rank `rank` holds (load-balanced for causal attention)."""
    return rank, 2 * cp - 1 - rank


def chunk_index(chunk: int, half: int, device: torch.device) -> torch.Tensor:
    """Global token indices of sequence chunk `chunk` (each chunk has `half` tokens)."""
    return torch.arange(chunk * half, (chunk + 1) * half, device=device)


@dataclass(frozen=True)
class Visibility:
    """The attention pattern: causal or not, and an optional sliding window (in positions)."""

    causal: bool = True
    window: int | None = None

    def geometric(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """[n, m] bool: query index i sees key index j by position alone."""
        distance = q_index[:, None] - k_index[None, :]
        seen = distance >= 0 if self.causal else torch.ones_like(distance, dtype=torch.bool)
        if self.window is not None:
            seen &= (distance < self.window) if self.causal else (distance.abs() < self.window)
        return seen

    def chunk_pair(self, q_chunk: int, k_chunk: int, half: int) -> str:
        """What the queries of `q_chunk` see of the keys of `k_chunk` by position alone: 'none', 'all' or 'some'
        (decided from the chunk numbers, with no tensor and no device synchronisation)."""
        if self.causal and k_chunk > q_chunk:
            return "none"
        gap = abs(q_chunk - k_chunk) * half
        nearest, farthest = max(0, gap - (half - 1)), gap + (half - 1)
        if self.window is not None and nearest >= self.window:
            return "none"
        diagonal = self.causal and q_chunk == k_chunk
        return "some" if diagonal or (self.window is not None and farthest >= self.window) else "all"

    def chunk_pair_seen(self, q_chunk: int, k_chunk: int, half: int) -> bool:
        """Whether any query of `q_chunk` sees any key of `k_chunk` (by position alone)."""
        return self.chunk_pair(q_chunk, k_chunk, half) != "none"

    def offsets(self, cp: int, half: int) -> list[int]:
        """Ring offsets some rank needs: 0 (its own block) first, then the others in order."""
        needed = [0]
        for offset in range(1, cp):
            if any(
                self.chunk_pair_seen(q, k, half)
                for rank in range(cp)
                for q in chunk_ids(rank, cp)
                for k in chunk_ids((rank - offset) % cp, cp)
            ):
                needed.append(offset)
        return needed


def block_mask(
    visibility: Visibility,
    chunks: tuple[int, int],
    half: int,
    q_starts: torch.Tensor | None,
    k_starts: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None | Literal[False]:
    """The mask of the block of query chunk `chunks[0]` and key chunk `chunks[1]`: False (nothing seen: skip
    it), None (everything seen), or a bool tensor broadcasting to the scores [batch, heads, n, m] (True = seen).
    Packed samples always give a tensor (which samples meet is the data's, not known without looking)."""
    kind = visibility.chunk_pair(chunks[0], chunks[1], half)
    if kind == "none":
        return False
    packed = q_starts is not None and k_starts is not None
    if kind == "all" and not packed:
        return None
    seen = visibility.geometric(chunk_index(chunks[0], half, device), chunk_index(chunks[1], half, device))
    if q_starts is not None and k_starts is not None:  # same packed sample: [batch, 1, n, m]
        seen = (seen & (q_starts[:, :, None] == k_starts[:, None, :]))[:, None]
    return seen
