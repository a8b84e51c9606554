"""A DistributedSampler that can start part-way through an epoch, for exact data resume.

Within an epoch every data-parallel rank reads the same seeded permutation, rank r taking positions
r, r + N, r + 2N, ... So after each of N ranks has read k samples, the global positions below k·N have been
seen and no others. Resuming means starting the epoch at global position `start = k·N`, and the remaining
positions are dealt out to the new ranks the same way — so a resume may change the number of ranks without
repeating or skipping a sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` plus `start`: the global position this epoch's iteration begins at (then reset)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0

    def __len__(self) -> int:
        return self.per_rank(self.start)

    def per_rank(self, start: int) -> int:
        """Samples each rank reads in an epoch begun at global position `start`."""
        remaining = max(0, len(self.dataset) - start)  # type: ignore[arg-type]
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def permutation(self) -> list[int]:
        """This epoch's order of the whole dataset (the same on every rank)."""
        size = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.permutation()[self.start :]
        per_rank = len(self)
        total = per_rank * self.num_replicas
        if not order:
            return iter([])
        if total > len(order):  # pad by repeating from the front, as DistributedSampler does
            order = (order * math.ceil(total / len(order)))[:total]
        return iter(order[self.rank : total : self.num_replicas])
