"""Sharded loading: disjoint per-rank data, per-epoch reshuffle, padding counts, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from meshkit.data.loader import DataLoaderError, shard_dataloader
from meshkit.training.accumulation import GradientState


def shard(loader: DataLoader, rank: int, world: int, seed: int = 0):
    return shard_dataloader(
        loader, dp_rank=rank, dp_size=world, seed=seed, device=torch.device("cpu"), state=GradientState(accum_steps=1)
    )


def ids_of(loader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def test_ranks_read_disjoint_parts_that_cover_the_data() -> None:
    data = TensorDataset(torch.arange(12))
    parts = [ids_of(shard(DataLoader(data, batch_size=2, shuffle=True), r, 3)) for r in range(3)]
    assert sorted(sum(parts, [])) == list(range(12))


def test_shuffle_changes_per_epoch_and_is_seeded() -> None:
    data = TensorDataset(torch.arange(32))
    loader = shard(DataLoader(data, batch_size=4, shuffle=True), 0, 2)
    first, second = ids_of(loader), ids_of(loader)
    assert len(first) == len(second) == 16 and first != second  # a new global permutation each epoch
    replay = shard(DataLoader(data, batch_size=4, shuffle=True), 0, 2)
    assert ids_of(replay) == first
    sequential = shard(DataLoader(data, batch_size=4), 1, 2)
    assert ids_of(sequential) == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]  # whole batches dealt


def test_end_of_data_marks_the_last_batch() -> None:
    state = GradientState(accum_steps=4)
    loader = shard_dataloader(
        DataLoader(TensorDataset(torch.arange(6)), batch_size=2),
        dp_rank=0,
        dp_size=1,
        seed=0,
        device=torch.device("cpu"),
        state=state,
    )
    flags = [state.end_of_dataloader for _ in loader]
    assert flags == [False, False, True]
    assert state.end_of_dataloader is False  # reset after the epoch


def test_valid_counts_name_the_padding() -> None:
    loader = shard(DataLoader(TensorDataset(torch.arange(10)), batch_size=3), 2, 4)
    for _ in loader:
        pass
    # 10 samples in batches of 3 on 4 ranks: one round of 12, completed from the front; rank 3 holds sample 9
    assert loader.valid_counts() == [3, 3, 3, 1]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("size", "batch", "world"), [(10, 3, 4), (7, 2, 2), (5, 2, 2), (3, 4, 2), (16, 2, 2)])
def test_ranks_get_the_batches_accelerate_deals(size, batch, world, drop_last) -> None:
    """Accelerate's prepared loader deals whole batches (rank r: batches r, r + world, ...) and completes the last
    round from the data's start; a script's per-batch metric sees the same rows under meshkit."""
    accelerate = pytest.importorskip("accelerate.data_loader")
    data = TensorDataset(torch.arange(size))
    for rank in range(world):
        ours = [
            [int(i) for i in b] for (b,) in shard(DataLoader(data, batch_size=batch, drop_last=drop_last), rank, world)
        ]
        sampler = BatchSampler(SequentialSampler(data), batch, drop_last)
        theirs = list(accelerate.BatchSamplerShard(sampler, num_processes=world, process_index=rank))
        assert ours == theirs, (rank, ours, theirs)


def test_custom_batch_sampler_is_refused_with_a_hint() -> None:
    data = TensorDataset(torch.arange(8))
    loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 2, False))
    with pytest.raises(DataLoaderError, match="custom sampler or batch_sampler"):
        shard(loader, 0, 2)


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


def test_iterable_dataset_passes_through_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="IterableDataset is not sharded"):
        loader = shard(DataLoader(Stream(), batch_size=2), 0, 2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


class _RecordSigint:
    """A user's worker_init_fn that writes down how its worker treats SIGINT (picklable for any start method)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        import signal
        from pathlib import Path

        Path(self.path, f"w{worker_id}").write_text(str(signal.getsignal(signal.SIGINT) == signal.SIG_IGN))


@pytest.mark.world
def test_data_loading_workers_leave_ctrl_c_to_the_training_process(tmp_path) -> None:
    from torch.utils.data import DataLoader

    from meshkit.data.loader import rebuilt

    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, worker_init_fn=_RecordSigint(str(tmp_path)))
    assert [batch.tolist() for batch in rebuilt(loader, batch_size=2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {path.read_text() for path in tmp_path.iterdir()} == {"True"}  # and the user's own init still ran
