"""Accelerate's verbs of meshkit.Accelerator (over its Engine): process facts, per-process decorators,
split_between_processes, trackers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshkit import Accelerator
from meshkit.compat.accelerate.verbs import _share
from meshkit.core.errors import MeshkitError
from meshkit.runtime.tracking import JsonlTracker
from tests.helpers.distributed import run_world


def test_split_between_processes_gives_contiguous_shares_padded_on_request() -> None:
    items = list(range(5))
    assert [_share(items, r, 2, False) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [_share(items, r, 2, True) for r in range(2)] == [[0, 1, 2], [3, 4, 4]]
    tensor = torch.arange(5)
    assert _share(tensor, 1, 2, True).tolist() == [3, 4, 4]
    assert _share({"a": items, "b": tensor}, 0, 2, False)["b"].tolist() == [0, 1, 2]


def _rank_facts(rank: int) -> dict:
    engine = Accelerator(hang_doctor=False, precision="bf16")
    ran = []

    @engine.on_main_process
    def main_only() -> str:
        ran.append("main")
        return "main"

    @engine.on_last_process
    def last_only() -> None:
        ran.append("last")

    @engine.on_process(process_index=1)
    def second_only() -> None:
        ran.append("second")

    returned = main_only()
    last_only()
    second_only()
    with engine.split_between_processes(["a", "b", "c"]) as mine:
        share = list(mine)
    facts = {
        "ran": ran,
        "returned": returned,
        "share": share,
        "local": engine.local_process_index,
        "last": engine.is_last_process,
        "precision": engine.mixed_precision,
    }
    engine.end()
    return facts


def test_process_facts_and_decorators_at_world_2() -> None:
    first, second = run_world(_rank_facts, 2)
    assert first["ran"] == ["main"] and first["returned"] == "main" and first["share"] == ["a", "b"]
    assert second["ran"] == ["last", "second"] and second["returned"] is None and second["share"] == ["c"]
    assert (first["local"], second["local"], first["last"], second["last"]) == (0, 1, False, True)
    assert first["precision"] == "bf16"


def test_accumulate_takes_the_model_as_accelerate_does_and_trackers_end_with_training(tmp_path) -> None:
    def train(named: bool) -> torch.Tensor:
        with Accelerator(hang_doctor=False, grad_accum_steps=2, logging={"dir": str(tmp_path)}) as engine:
            torch.manual_seed(0)
            model = nn.Linear(3, 1)
            model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for step in range(4):
                with engine.accumulate(model) if named else engine.accumulate():
                    engine.backward(model(torch.full((2, 3), float(step))).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
            assert isinstance(engine.get_tracker("jsonl"), JsonlTracker)
            with pytest.raises(MeshkitError, match=r"the run's trackers are \['jsonl'\]"):
                engine.get_tracker("wandb")
            engine.end_training()
            assert engine.get_tracker("jsonl") is None  # closed
            assert engine.free_memory(model, optimizer) == [None, None]
            return model.weight.detach().clone()

    assert torch.equal(train(named=True), train(named=False))
