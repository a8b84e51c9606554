"""A DistributedSampler that can start part-way through an epoch, for exact data resume.

Within an epoch every data-parallel rank reads the same seeded permutation, dealt in whole batches as
Accelerate deals them: with batch size B and N ranks, rank r's i-th batch is positions (i·N + r)·B to
(i·N + r + 1)·B. So after each rank has read k batches, the global positions below k·B·N have been seen and no
others. Resuming means starting the epoch at global position `start = k·B·N`, and the remaining positions are
dealt out to the new ranks the same way — so a resume may change the number of ranks without repeating or
skipping a sample. The last round is completed with positions from the epoch's start (Accelerate's
`even_batches`), or dropped under `drop_last`; with B = 1 the dealing is DistributedSampler's round-robin.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DistributedSampler


def dataset_length(dataset: Any) -> int:
    """`len()` of a map-style dataset (torch's `Dataset` type declares no `__len__`; a sampler needs one)."""
    return len(cast(Sized, dataset))


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` plus `start`: the global position this epoch's iteration begins at (then reset)."""

    def __init__(self, *args, batch_size: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0
        self.batch_size = batch_size  # the block each rank is dealt at a time

    def __len__(self) -> int:
        return self.per_rank(self.start)

    def per_rank(self, start: int) -> int:
        """Samples each rank reads in an epoch begun at global position `start`."""
        remaining = max(0, dataset_length(self.dataset) - start)
        per_round = self.batch_size * self.num_replicas
        rounds = remaining // per_round if self.drop_last else math.ceil(remaining / per_round)
        return rounds * self.batch_size

    def position(self, batch: int, rank: int, row: int) -> int:
        """The epoch position (counted from `start`) of row `row` of rank `rank`'s batch `batch`."""
        return (batch * self.num_replicas + rank) * self.batch_size + row

    def permutation(self) -> list[int]:
        """This epoch's order of the whole dataset (the same on every rank)."""
        size = dataset_length(self.dataset)
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
        if total > len(order):  # complete the last round from the front, as Accelerate's even batches do
            order = (order * math.ceil(total / len(order)))[:total]
        batches = range(per_rank // self.batch_size)
        return iter([order[self.position(i, self.rank, row)] for i in batches for row in range(self.batch_size)])
