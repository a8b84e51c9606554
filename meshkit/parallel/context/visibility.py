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

    def chunk_pair_seen(self, q_chunk: int, k_chunk: int, half: int) -> bool:
        """Whether any query of `q_chunk` sees any key of `k_chunk` (by position alone)."""
        if self.causal and k_chunk > q_chunk:
            return False
        if self.window is None:
            return True
        closest = abs(q_chunk - k_chunk) * half - (half - 1) if q_chunk != k_chunk else 0
        return closest < self.window

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
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    q_starts: torch.Tensor | None,
    k_starts: torch.Tensor | None,
) -> torch.Tensor | None | bool:
    """The block's mask: False (nothing seen: skip it), None (everything seen), or a bool tensor broadcasting
    to the scores [batch, heads, n, m] (True = seen)."""
    seen = visibility.geometric(q_index, k_index)
    if q_starts is not None and k_starts is not None:  # same packed sample: [batch, 1, n, m]
        seen = (seen & (q_starts[:, :, None] == k_starts[:, None, :]))[:, None]
    if not bool(seen.any()):
        return False
    if bool(seen.all()):
        return None
    return seen
