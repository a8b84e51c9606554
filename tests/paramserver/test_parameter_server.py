"""strategy=parameter_server: sync equals DDP, async under a staleness bound, lost workers, checkpoints."""

from __future__ import annotations

import pytest
import torch

from meshkit.config import RunConfig
from meshkit.paramserver.layout import make_shards, place_parameters
from meshkit.paramserver.roles import ParameterServerError, check_parameter_server
from tests.helpers.cli import meshkit
from tests.helpers.distributed import run_world
from tests.helpers.ps_runs import logistic_data, logistic_loss, train, train_logistic

PS = {"strategy": "parameter_server"}


def _workers(results: list) -> list:
    return [r for r in results if r is not None and r["is_worker"]]


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-12)) for n in a)


def test_parameters_are_placed_by_size_and_every_rank_agrees() -> None:
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    assert place_parameters(sizes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    named = [(n, torch.nn.Parameter(torch.zeros(k))) for n, k in sizes.items()]
    shards = make_shards(named, 2)
    assert [s.names for s in shards] == [("a", "d"), ("b", "c")]  # model order inside a shard
    flat = shards[1].flatten([torch.ones(60), None])
    assert flat.shape == (110,) and float(flat.sum()) == 60.0
    assert [v.shape for v in shards[1].views(flat)] == [torch.Size([60]), torch.Size([50])]


@pytest.mark.parametrize(
    ("settings", "world", "fragment"),
    [
        ({"ps": {"servers": 2}}, 2, "leaves no worker in a world of 2"),
        ({"parallel": {"tp": 2}}, 4, "does not combine with tp=2"),
        ({"sharding": {"zero_stage": 2}}, 4, "does not combine with zero_stage=2"),
    ],
)
def test_settings_that_do_not_fit_are_refused_in_one_line(settings: dict, world: int, fragment: str) -> None:
    config = RunConfig(**PS, **settings)
    with pytest.raises(ParameterServerError, match=fragment) as caught:
        check_parameter_server(config, world, 0)
    assert "\n" not in str(caught.value)


def test_async_settings_are_refused_with_sync_mode() -> None:
    with pytest.raises(ValueError, match="apply to mode=async"):
        RunConfig(**PS, ps={"max_staleness": 2})


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_equals_ddp_over_ten_steps(servers: int) -> None:
    """SGD with momentum and a step LR schedule: 2 workers (+ the servers) against DDP on 2 ranks, same data."""
    ddp = run_world(train, 2, {}, 10, 4, {}, timeout=120)
    served = run_world(train, servers + 2, {**PS, "ps": {"servers": servers}}, 10, 4, {}, timeout=120)
    reference = {name.removeprefix("module."): t for name, t in ddp[0]["weights"].items()}
    workers = _workers(served)
    assert len(workers) == 2
    for worker, ddp_rank in zip(workers, ddp, strict=True):
        assert _relative(worker["weights"], reference) <= 1e-6
        assert worker["losses"] == pytest.approx(ddp_rank["losses"], rel=1e-6)
        assert worker["lr"] == pytest.approx(ddp_rank["lr"])  # the servers' schedule stepped once per step
    assert all(r["staleness"] == {0: 20} for r in served if not r["is_worker"])


def test_async_with_staleness_zero_equals_sync() -> None:
    sync = run_world(train, 3, PS, 8, 4, {}, timeout=120)
    bound0 = run_world(train, 3, {**PS, "ps": {"mode": "async", "max_staleness": 0}}, 8, 4, {}, timeout=120)
    for a, b in zip(_workers(bound0), _workers(sync), strict=True):
        assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])


def test_async_never_applies_a_gradient_older_than_the_bound() -> None:
    """Three workers of jittered speed: the servers tag every gradient with the version it was computed on."""
    results = run_world(
        train,
        5,
        {**PS, "ps": {"servers": 2, "mode": "async", "max_staleness": 2}},
        16,
        4,
        {"jitter_s": 0.03},
        timeout=180,
    )
    for server in (r for r in results if not r["is_worker"]):
        assert sum(server["staleness"].values()) == 3 * 16
        assert max(server["staleness"]) <= 2
        assert max(server["staleness"]) >= 1  # the workers did run apart (else the bound was never tested)


@pytest.mark.slow
def test_async_converges_like_sync_on_logistic_regression() -> None:
    sync = run_world(train_logistic, 4, PS, 10, 0.004, timeout=240)
    stale = run_world(train_logistic, 4, {**PS, "ps": {"mode": "async", "max_staleness": 2}}, 10, 0.004, timeout=240)
    data = logistic_data()
    sync_loss = logistic_loss(_workers(sync)[0]["weights"], data)
    server = next(r for r in stale if not r["is_worker"])
    stale_loss = logistic_loss(server["weights"], data)  # the servers hold the final weights
    assert max(server["staleness"]) >= 1
    assert abs(stale_loss - sync_loss) <= 0.01 * sync_loss, (stale_loss, sync_loss)


@pytest.mark.parametrize("bound", [None, 1])
def test_a_killed_async_worker_does_not_stop_the_others(bound: int | None, capfd) -> None:
    settings = {**PS, "ps": {"mode": "async", "max_staleness": bound}}
    results = run_world(
        train, 4, settings, 12, 4, {"die_at": (1, 4), "jitter_s": 0.01}, timeout=120, may_die=frozenset({2})
    )
    assert results[2] is None  # worker index 1 (rank 2) killed itself at its step 4
    assert [len(r["losses"]) for r in _workers(results)] == [12, 12]
    assert results[0]["dead"] == [2]
    assert "worker rank 2 is gone at its step" in capfd.readouterr().out


@pytest.mark.slow
def test_a_checkpoint_resumes_into_the_same_weights(tmp_path) -> None:
    settings = {**PS, "ps": {"servers": 2}}
    straight = run_world(
        train,
        4,
        {**settings, "checkpoint": {"dir": str(tmp_path / "a"), "every_steps": 4}},
        10,
        4,
        {"checkpoint_every": 1},
        timeout=120,
    )
    saving = {**settings, "checkpoint": {"dir": str(tmp_path / "b"), "every_steps": 4, "resume": "auto"}}
    run_world(train, 4, saving, 6, 4, {"checkpoint_every": 1}, timeout=120)
    saved = tmp_path / "b" / "step-000004"
    assert sorted(p.name for p in saved.iterdir()) == [
        "manifest.json",
        "meta.json",
        "ps-server-00000.safetensors",
        "ps-server-00001.safetensors",
        "rank-00000.json",
        "rank-00001.json",
        "rank-00002.json",
        "rank-00003.json",
    ]
    # resumed with one server instead of two: the shards are read by parameter name
    resumed = run_world(
        train, 3, {**saving, "ps": {"servers": 1}}, 10, 4, {"checkpoint_every": 1, "resume": True}, timeout=120
    )
    for a, b in zip(_workers(resumed), _workers(straight), strict=True):
        assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
        assert a["losses"] == b["losses"][4:]


def test_a_lost_server_stops_every_worker_with_a_line_naming_it() -> None:
    results = run_world(
        train,
        3,
        {**PS, "ps": {"mode": "async"}},
        100_000,
        4,
        {"server_dies_after_s": 2.0, "jitter_s": 0.01},
        timeout=120,
        may_die=frozenset({0}),
    )
    for worker in results[1:]:
        assert "parameter server rank 0 is gone" in worker["error"] and "the job stops" in worker["error"]
        assert worker["losses"]  # it had been training


def test_a_lost_worker_stops_a_synchronous_run_with_a_line_naming_it() -> None:
    results = run_world(train, 3, PS, 12, 4, {"die_at": (1, 4)}, timeout=120, may_die=frozenset({2}))
    assert "worker rank 2 is gone" in results[0]["error"] and "ps.mode=async" in results[0]["error"]
    assert "parameter server rank 0 is gone" in results[1]["error"]


LOSES_A_WORKER = """
import os, signal, sys, time
import torch
from torch import nn
from meshkit import Engine
mode = sys.argv[1]
engine = Engine(strategy="parameter_server", ps={"mode": mode}, hang_doctor=False)
torch.manual_seed(0)
model = nn.Linear(4, 1)
model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.mse_loss)
for step in range(30 if engine.is_worker else 0):
    if engine.process_index == 3 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if "every" in sys.argv and step == 2:
        raise ValueError("every worker fails")
    time.sleep(0.02)
    engine.train_step((torch.randn(8, 4), torch.randn(8, 1)))
sys.stdout.write(f"DONE rank {engine.process_index} steps {engine.step}\\n")
sys.stdout.flush()
engine.end()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_under_meshkit_launch_a_lost_worker_stops_a_sync_job_but_not_an_async_one(tmp_path, mode: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(LOSES_A_WORKER)
    proc = meshkit("launch", "--nproc-per-node", "4", str(script), mode, timeout=120)
    if mode == "sync":  # as under DDP: the job stops, naming the lost worker
        assert proc.returncode != 0 and "rank 3 (local rank 3) was killed by signal SIGKILL" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert all(f"DONE rank {rank} steps" in proc.stdout for rank in (0, 1, 2)), proc.stdout
    assert "DONE rank 1 steps 30" in proc.stdout and "DONE rank 3" not in proc.stdout
    assert "worker rank 3 is gone" in proc.stdout
    assert "rank 3 (local rank 3) was lost (killed by SIGKILL)" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_under_meshkit_launch_an_async_job_that_loses_every_worker_fails(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(LOSES_A_WORKER)
    proc = meshkit("launch", "--nproc-per-node", "3", str(script), "async", "every", timeout=120)
    assert proc.returncode != 0 and "ValueError: every worker fails" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_serving_and_a_long_pause_of_one_worker_outlast_the_collective_timeout() -> None:
    """Hang doctor on, collective timeout 2 s: the servers serve for longer than that, and an async worker
    pausing 8 s between two steps (an evaluation) is neither diagnosed as a hang nor dropped (the doctor ends a
    phase at timeout + 5 s; gloo closes every connection when a receive outlasts the timeout)."""
    settings = {**PS, "ps": {"mode": "async"}, "hang_doctor": True, "collective_timeout_s": 2.0}
    results = run_world(train, 3, settings, 8, 4, {"pause_at": (0, 2), "pause_s": 8.0, "jitter_s": 0.2}, timeout=120)
    assert [len(r["losses"]) for r in _workers(results)] == [8, 8]
    assert results[0]["dead"] == []
