"""Engine helpers: main-process-only work, trackers, unwrap, and clear errors for wrong use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshkit import Engine
from meshkit.engine import EngineError
from meshkit.engine.gradients import GradientError
from meshkit.runtime.tracking import TrackerError
from meshkit.training.loss import LossError
from tests.helpers.distributed import run_world
from tests.helpers.training import tiny_gpt


def main_process_rank(rank: int, run_dir: str) -> dict:
    engine = Engine(logging={"dir": run_dir})
    order = []
    marker = Path(run_dir) / "prepared"
    with engine.main_process_first():
        order.append(marker.exists())  # the main process writes it; the others wait and then see it
        if engine.is_main_process:
            marker.write_text("done")
    engine.log({"loss": torch.tensor(1.5), "step_time": 0.1, "note": "text is skipped"}, step=1)
    engine.wait_for_everyone()
    model = engine.prepare(tiny_gpt())
    result = {
        "saw_marker": order[0],
        "main": engine.is_main_process,
        "wrapped": type(model).__name__,
        "unwrapped": type(engine.unwrap_model()).__name__,
    }
    engine.end()
    return result


def test_main_process_first_and_logging_on_the_main_process_only(tmp_path) -> None:
    results = run_world(main_process_rank, 2, str(tmp_path), timeout=120)
    assert results[0]["saw_marker"] is False and results[1]["saw_marker"] is True
    assert [r["main"] for r in results] == [True, False]
    assert all(r["wrapped"] == "DistributedDataParallel" and r["unwrapped"] == "GPT" for r in results)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # one writer, not one per rank
    record = json.loads(lines[0])
    assert record["step"] == 1 and record["loss"] == 1.5 and "note" not in record


def test_wrong_use_gets_clear_errors() -> None:
    with Engine() as engine:
        with pytest.raises(EngineError, match="takes models, optimizers, DataLoaders and LR schedulers, not str"):
            engine.prepare("model")
        with pytest.raises(EngineError, match="exactly one prepared model, found 0"):
            engine.train_step(torch.zeros(1))
        model = engine.prepare(torch.nn.Linear(2, 1))
        engine.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(LossError, match=r"carries no scalar loss \(a tensor of shape \[3, 1\]\): pass loss_fn="):
            engine.train_step(torch.zeros(3, 2))


def test_mixing_item_weighting_within_a_window_is_refused() -> None:
    with Engine(grad_accum_steps=2) as engine:
        model = engine.prepare(torch.nn.Linear(2, 1))
        with engine.accumulate():
            engine.backward(model(torch.ones(1, 2)).sum(), num_items=1)
        with engine.accumulate(), pytest.raises(GradientError, match="on every micro-step"):
            engine.backward(model(torch.ones(1, 2)).sum())


def unsupported_layout_rank(rank: int) -> str:
    import torch.distributed as dist

    try:
        Engine(zero_stage=3, dp_replicate=2, dp_shard=2)  # (4 ranks in a world of 2)
    except ValueError as err:
        return f"{err} | group left: {dist.is_initialized()}"
    return "no error"


def test_unsupported_layout_fails_before_training_and_leaves_no_process_group() -> None:
    for message in run_world(unsupported_layout_rank, 2, timeout=120):
        assert message.startswith("parallel sizes") and "multiply to 4" in message and message.endswith("left: False")


def test_missing_tracker_package_fails_before_training(monkeypatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real_find_spec(name, *a)
    )
    with pytest.raises(TrackerError, match=r"pip install 'meshkit\[tensorboard\]'"):
        Engine(logging={"trackers": "jsonl,tensorboard"})


def test_wandb_tracker_runs_offline_without_credentials_with_the_metrics_and_config(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")  # part of the dev extra, so CI runs it
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: no credentials
    run_dir = tmp_path / "run"
    settings = {"dir": str(run_dir), "trackers": ["jsonl", "wandb"]}
    with Engine(logging=settings, train={"dataset": "corpus-zq81.txt"}, hang_doctor=False) as engine:
        engine.start_trackers("proj-w4", config={"user_key_q9": 3}, init_kwargs={"wandb": {"tags": ["tag-x7"]}})
        engine.log({"loss": 0.731942}, step=1)
        engine.log({"loss": 0.518206}, step=2)
    assert "wandb runs offline (no credentials)" in capsys.readouterr().out
    (record,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = record.read_bytes()  # the run's record log: metrics and the resolved config, as written
    assert b"0.731942" in data and b"0.518206" in data and b"corpus-zq81.txt" in data
    assert b"proj-w4" in data and b"user_key_q9" in data and b"tag-x7" in data  # init_trackers' project, config, kwargs
    monkeypatch.setenv("WANDB_MODE", "disabled")  # honoured as given
    with Engine(logging={"dir": str(tmp_path / "off"), "trackers": ["wandb"]}, hang_doctor=False) as engine:
        engine.log({"loss": 1.0}, step=1)
    assert not list((tmp_path / "off").glob("wandb/offline-run-*"))


def test_tensorboard_tracker_writes_scalars(tmp_path) -> None:
    pytest.importorskip("tensorboard")  # part of the dev extra, so CI runs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Engine(logging={"dir": str(tmp_path), "trackers": ["jsonl", "tensorboard"]}) as engine:
        engine.log({"loss": 2.0}, step=1)
        engine.log({"loss": 1.0}, step=2)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.0), (2, 1.0)]


def test_the_users_omp_num_threads_is_kept(monkeypatch) -> None:
    """OMP_NUM_THREADS=1 exported: the Engine runs torch on one thread, not on its share of the cores."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        torch.set_num_threads(2)  # what a default share would give on this 2-core host
        with Engine() as engine:
            assert engine.affinity.threads == 1 and torch.get_num_threads() == 1
            assert engine.resolved.sources["threads_per_process"] == "env OMP_NUM_THREADS"
    finally:
        torch.set_num_threads(before)
