"""Per-rank micro-batch sizes (mixed hardware): the same steps as a uniform split of the same global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from meshkit import Engine
from meshkit.data.loader import shard_dataloader
from meshkit.data.uneven import UnevenBatchError, per_rank_sizes
from meshkit.training.accumulation import GradientState
from tests.helpers.distributed import run_world
from tests.helpers.ps_runs import dataset, model


def _train(rank: int, overrides: dict[str, Any], loader_batch: int, steps: int, accum: int) -> dict[str, Any]:
    engine = Engine(hang_doctor=False, grad_accum_steps=accum, **overrides)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(dataset(96), batch_size=loader_batch, shuffle=True)
    net, optimizer, loader = engine.prepare(
        net, optimizer, loader, loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[1])
    )
    sizes = []
    for batch in loader if engine.is_worker else ():
        sizes.append(len(batch[0]))
        engine.train_step((batch[0], batch))
        if engine.step >= steps:
            break
    weights = {n.removeprefix("module."): p.detach().clone() for n, p in net.named_parameters()}
    engine.end()
    return {"weights": weights, "sizes": sizes, "worker": engine.is_worker}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in a)


@pytest.mark.parametrize("accum", [1, 2])
def test_uneven_sizes_equal_the_uniform_split_of_the_same_global_batch(accum: int) -> None:
    uniform = run_world(_train, 2, {}, 2, 6, accum, timeout=120)
    uneven = run_world(_train, 2, {"train": {"micro_batch_size": [3, 1]}}, 2, 6, accum, timeout=120)
    assert [len(set(r["sizes"])) for r in uneven] == [1, 1]
    assert [r["sizes"][0] for r in uneven] == [3, 1]
    assert _equal(uneven[0]["weights"], uniform[0]["weights"]) <= 1e-6


def test_a_node_map_gives_every_rank_of_a_node_its_size() -> None:
    """LOCAL_WORLD_SIZE=1: each rank is its own node, so {0: 3, 1: 1} is the list [3, 1]."""
    listed = run_world(_train, 2, {"train": {"micro_batch_size": [3, 1]}}, 2, 4, 1, timeout=120)
    mapped = run_world(
        _train, 2, {"train": {"micro_batch_size": {0: 3, 1: 1}}}, 2, 4, 1, timeout=120, env={"LOCAL_WORLD_SIZE": "1"}
    )
    assert [r["sizes"][0] for r in mapped] == [3, 1]
    assert all(torch.equal(mapped[0]["weights"][n], listed[0]["weights"][n]) for n in listed[0]["weights"])


def test_parameter_server_workers_with_uneven_sizes_equal_uniform_ddp() -> None:
    uniform = run_world(_train, 2, {}, 2, 6, 1, timeout=120)
    served = run_world(
        _train, 3, {"strategy": "parameter_server", "train": {"micro_batch_size": [1, 3]}}, 2, 6, 1, timeout=120
    )
    workers = [r for r in served if r["worker"]]
    assert [r["sizes"][0] for r in workers] == [1, 3]
    assert _equal(workers[0]["weights"], uniform[0]["weights"]) <= 1e-6


def test_the_uneven_position_resumes_exactly() -> None:
    def loader() -> Any:
        plain = DataLoader(list(range(40)), batch_size=2, shuffle=True)
        return shard_dataloader(
            plain,
            dp_rank=1,
            dp_size=2,
            seed=0,
            device=torch.device("cpu"),
            state=GradientState(accum_steps=1),
            sizes=[3, 2],
        )

    straight = [batch.tolist() for batch in loader()]
    assert len(straight) == 8 and all(len(b) == 2 for b in straight)  # 40 // 5 global batches, 2 samples each
    first = loader()
    iterator = iter(first)
    seen = [next(iterator).tolist() for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert seen + [batch.tolist() for batch in resumed] == straight


def test_sizes_that_do_not_fit_are_refused_in_one_line() -> None:
    with pytest.raises(UnevenBatchError, match="has 3 sizes for 2 data-parallel ranks") as caught:
        per_rank_sizes([1, 2, 3], 2, None, 0, {})
    assert "\n" not in str(caught.value)
    with pytest.raises(UnevenBatchError, match="do not combine with pp=2"):
        per_rank_sizes([1, 2], 2, None, 0, {"pp": 2, "cp": 1})
    with pytest.raises(UnevenBatchError, match="not node 1: add it"):
        per_rank_sizes({0: 2}, 2, None, 1, {})
