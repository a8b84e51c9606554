"""gather, gather_for_metrics (no padding duplicates) and reduce over real gloo worlds."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from meshkit import Engine
from tests.helpers.distributed import run_world

N_SAMPLES = 10


def metrics_rank(rank: int, batch_size: int) -> dict:
    engine = Engine(logging={"dir": "/tmp/meshkit-test-runs"})
    ids = torch.arange(N_SAMPLES)
    loader = engine.prepare(DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=True))
    tensors, names = [], []
    for (batch_ids,) in loader:
        tensors.append(engine.gather_for_metrics(batch_ids * 10))
        names.extend(engine.gather_for_metrics([f"sample-{int(i)}" for i in batch_ids]))
    plain = engine.gather(torch.tensor([rank]))
    total = engine.reduce(torch.tensor(float(rank)), op="sum")
    mean = engine.reduce(torch.tensor(float(rank)))
    engine.end()
    return {"tensors": torch.cat(tensors), "names": names, "plain": plain, "sum": total, "mean": mean}


def test_gather_for_metrics_returns_exactly_the_dataset() -> None:
    # world 4, batch 3: 10 samples in one round of 12, completed from the front: rank 3 holds one real sample
    for result in run_world(metrics_rank, 4, 3, timeout=120):
        assert sorted(result["tensors"].tolist()) == [10 * i for i in range(N_SAMPLES)]
        assert sorted(result["names"]) == sorted(f"sample-{i}" for i in range(N_SAMPLES))
        assert result["plain"].tolist() == [0, 1, 2, 3]
        assert result["sum"].item() == 6
        assert result["mean"].item() == 1.5


def test_gather_for_metrics_with_several_batches() -> None:
    # world 3, batch 2: two rounds of 6, the second completed from the front (rank 2: padding only)
    for result in run_world(metrics_rank, 3, 2, timeout=120):
        assert sorted(result["tensors"].tolist()) == [10 * i for i in range(N_SAMPLES)]
        assert len(result["names"]) == N_SAMPLES


def out_of_step_rank(rank: int) -> str:
    """Rank 1 gathers one batch later than rank 0: a count cut from one rank's own place would differ per rank."""
    from meshkit.engine.processes import MetricsError

    engine = Engine(logging={"dir": "/tmp/meshkit-test-runs"})
    loader = engine.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
    batches = iter(loader)
    next(batches)
    if rank == 1:
        next(batches)
    try:
        engine.gather_for_metrics(torch.zeros(2))
    except MetricsError as error:
        return str(error)
    finally:
        engine.end()
    return "gathered"


def test_ranks_at_different_batches_are_refused_in_one_line() -> None:
    for message in run_world(out_of_step_rank, 2, timeout=120):
        assert message.startswith("gather_for_metrics: the ranks stand at different batches")
        assert "rank 0: epoch 0 batch 0, rank 1: epoch 0 batch 1" in message and "\n" not in message
