"""Uneven per-rank batches for mixed hardware: `train.micro_batch_size: [8, 4, 4]` (one size per data-parallel
rank) or `{0: 8, 1: 4}` (one size per node rank, for every rank on that node).

Each step's global batch is the next Σ sizes positions of the epoch's seeded permutation — the same samples a
uniform split of that global batch reads — and rank r takes its own contiguous slice of it. The engine weights
each rank's gradient by its samples (a rank's mean loss counts b_r / Σ b), so the step equals the uniform
split's. An incomplete last global batch is dropped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from meshkit.core.errors import MeshkitError
from meshkit.runtime import collectives


class UnevenBatchError(MeshkitError):
    """Per-rank batch sizes that do not fit the run."""


def per_rank_sizes(setting: Any, dp_size: int, group: Any, node_rank: int, split: dict[str, int]) -> list[int]:
    """Every data-parallel rank's micro-batch size, in dp-rank order, from a list (per dp rank) or a map (per node
    rank); with a map each rank states its own size and they are gathered over the data-parallel group.
    `split`: the pp and cp sizes (a rank's share of a batch must be whole samples of one stage)."""
    others = [f"{name}={size}" for name, size in split.items() if size > 1]
    if others:
        raise UnevenBatchError(
            f"per-rank micro-batch sizes split data-parallel batches and do not combine with {', '.join(others)}: "
            "give train.micro_batch_size one size"
        )
    if isinstance(setting, (list, tuple)):
        if len(setting) != dp_size:
            raise UnevenBatchError(
                f"train.micro_batch_size has {len(setting)} sizes for {dp_size} data-parallel ranks: give one per "
                f"rank (engine.dp_size), or a map of node rank to size"
            )
        return [int(size) for size in setting]
    node = node_rank
    if node not in setting:
        raise UnevenBatchError(
            f"train.micro_batch_size maps node ranks {sorted(setting)} to sizes but not node {node}: add it"
        )
    return [int(size) for size in collectives.gather_object(int(setting[node]), group)]


class UnevenBatchSampler(Sampler[list[int]]):
    """Yields this rank's index list of each global batch; resumable at a global position like ResumableSampler."""

    def __init__(self, dataset_len: int, sizes: list[int], rank: int, *, shuffle: bool, seed: int) -> None:
        self.dataset_len, self.sizes, self.rank = dataset_len, sizes, rank
        self.shuffle, self.seed = shuffle, seed
        self.global_batch = sum(sizes)
        self.offset = sum(sizes[:rank])
        self.epoch = 0
        self.start = 0  # global position this epoch's iteration begins at (a resumed epoch), then reset

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return max(0, self.dataset_len - self.start) // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        mine = self.sizes[self.rank]
        for step in range(len(self)):
            first = self.start + step * self.global_batch + self.offset
            yield order[first : first + mine]


def node_rank(rank: int, local_world_size: int) -> int:
    """This process's node: the launcher's GROUP_RANK, else its rank over the ranks per node."""
    return int(os.environ.get("GROUP_RANK", rank // max(1, local_world_size)))
