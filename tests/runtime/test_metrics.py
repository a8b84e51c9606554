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
    # world 4, batch 3: 10 samples padded to 12; the padding sits inside rank blocks, not at the end
    for result in run_world(metrics_rank, 4, 3, timeout=120):
        assert sorted(result["tensors"].tolist()) == [10 * i for i in range(N_SAMPLES)]
        assert sorted(result["names"]) == sorted(f"sample-{i}" for i in range(N_SAMPLES))
        assert result["plain"].tolist() == [0, 1, 2, 3]
        assert result["sum"].item() == 6
        assert result["mean"].item() == 1.5


def test_gather_for_metrics_with_several_batches() -> None:
    # world 3, batch 2: 10 samples padded to 12, two batches per rank, the last one partly padding
    for result in run_world(metrics_rank, 3, 2, timeout=120):
        assert sorted(result["tensors"].tolist()) == [10 * i for i in range(N_SAMPLES)]
        assert len(result["names"]) == N_SAMPLES
