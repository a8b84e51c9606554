"""`meshkit launch` end to end: workers start, see the resolved settings, and failures are reported."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.helpers.cli import meshkit
from tests.helpers.distributed import free_port
from tests.multinode.hosts import covered_on_two_hosts

SCRIPT = """
import json, os, sys
import torch
from meshkit import Engine
engine = Engine()
total = engine.reduce(torch.tensor(float(engine.process_index)), op="sum").item()
if "fail" in sys.argv and engine.process_index == 1:
    raise ValueError("boom on rank 1")
sys.stdout.write("RESULT " + json.dumps({
    "rank": engine.process_index, "world": engine.num_processes, "sum": total, "argv": sys.argv[1:],
    "precision": engine.config.precision, "precision_source": engine.resolved.sources["precision"],
    "seed": engine.config.seed, "seed_source": engine.resolved.sources["seed"], "threads": torch.get_num_threads(),
    "master_port": int(os.environ["MASTER_PORT"]),
}) + "\\n")  # one write: lines of two ranks never interleave
sys.stdout.flush()
engine.end()
"""


EPHEMERAL_LOW = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def results(stdout: str) -> list[dict]:
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines() if "RESULT " in line]
    return sorted(rows, key=lambda row: row["rank"])


def test_launch_runs_every_rank_with_the_resolved_settings(script, tmp_path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text("seed: 11\n")
    proc = meshkit(
        "launch", "--nproc-per-node", "2", "--precision", "bf16", "--config-file", str(config), str(script), "--x", "1"
    )
    assert proc.returncode == 0, proc.stderr
    assert "has no effect" not in proc.stderr  # every setting given here is used
    rows = results(proc.stdout)
    assert [row["rank"] for row in rows] == [0, 1]
    for row in rows:
        assert row["world"] == 2 and row["sum"] == 1.0
        assert row["argv"] == ["--x", "1"]  # the script's own flags pass through untouched
        assert row["precision"] == "bf16" and row["precision_source"] == "flag --precision"
        assert row["seed"] == 11 and row["seed_source"].startswith("file ")
        assert row["threads"] >= 1
        # one node: the workers' store port is the launcher's pick below the ephemeral range (no other socket on
        # the host is given it meanwhile)
        assert row["master_port"] < EPHEMERAL_LOW


def test_an_address_that_changes_nothing_on_one_node_is_one_notice(script) -> None:
    proc = meshkit("launch", "--nproc-per-node", "1", "--master-addr", "10.255.255.1", str(script))
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "has no effect" in line]
    assert notes == [
        "meshkit launch: master_addr=10.255.255.1 (flag --master-addr) has no effect on one node: its ranks meet on "
        "loopback (it is used with nnodes > 1)"
    ], proc.stderr
    assert [row["world"] for row in results(proc.stdout)] == [1]


def test_a_failing_rank_gives_a_nonzero_exit_naming_its_error(script) -> None:
    proc = meshkit("launch", "--nproc-per-node", "2", str(script), "fail")
    assert proc.returncode != 0
    assert "rank 1 (local rank 1, exit code 1): ValueError: boom on rank 1" in proc.stderr


def test_missing_script_is_an_error(tmp_path) -> None:
    proc = meshkit("launch", "--nproc-per-node", "2", str(tmp_path / "nope.py"))
    assert proc.returncode == 2
    assert "nope.py' does not exist" in proc.stderr


def test_port_in_use_is_named(script) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = meshkit("launch", "--nproc-per-node", "1", "--master-port", str(port), str(script))
    assert proc.returncode == 2
    assert f"port {port} is in use" in proc.stderr


@covered_on_two_hosts("a missing node is tested on two simulated hosts (tests/multinode)")
def test_a_node_that_never_joins_fails_at_the_rendezvous_timeout(script) -> None:
    proc = meshkit(
        "launch",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-port",
        str(free_port()),
        "--rdzv-timeout",
        "4",
        str(script),
        timeout=60,  # a hang fails here
    )
    assert proc.returncode != 0
    assert "timed out after 4s: expected 2 nodes, 1 alive" in proc.stderr, proc.stderr[-2000:]


@covered_on_two_hosts("two nodes are tested on two simulated hosts (tests/multinode)")
def test_two_nodes_on_one_host_rendezvous(script) -> None:
    import os
    import subprocess
    import sys

    port = str(free_port())
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", port, "--rdzv-timeout", "60", str(script)]
    node0 = subprocess.Popen(
        [sys.executable, "-m", "meshkit.cli", "launch", "--node-rank", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        node1 = meshkit("launch", "--node-rank", "1", *args, timeout=90)
        out0, err0 = node0.communicate(timeout=90)
    finally:
        node0.kill()
    assert node1.returncode == 0 and node0.returncode == 0, node1.stderr + err0
    rows = results(out0) + results(node1.stdout)
    assert sorted(row["rank"] for row in rows) == [0, 1]
    assert all(row["world"] == 2 and row["sum"] == 1.0 for row in rows)


def test_module_mode_and_unknown_module(tmp_path) -> None:
    proc = meshkit("launch", "--nproc-per-node", "1", "-m", "no_such_module_xyz")
    assert proc.returncode == 2 and "module 'no_such_module_xyz' was not found" in proc.stderr


@pytest.mark.slow
def test_max_restarts_restarts_failed_workers(tmp_path) -> None:
    script = tmp_path / "flaky.py"
    script.write_text(
        "import os, sys\n"
        "from meshkit import Engine\n"
        "engine = Engine()\n"
        "attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "if attempt == 0 and engine.process_index == 1:\n"
        "    raise RuntimeError('first attempt fails')\n"
        "sys.stdout.write(f'DONE rank {engine.process_index} attempt {attempt}\\n')\n"
        "engine.end()\n"
    )
    proc = meshkit("launch", "--nproc-per-node", "2", "--max-restarts", "1", str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "DONE rank 0 attempt 1" in proc.stdout and "DONE rank 1 attempt 1" in proc.stdout
    # Restarts that run out: tests/faults/test_failure_reports.py


def test_what_the_launcher_tells_its_workers_is_never_read_as_config(tmp_path) -> None:
    """Every MESHKIT_* variable a worker inherits from the launcher resolves cleanly: none is taken for a key."""
    from meshkit.config import LaunchSettings
    from meshkit.config.resolve import resolve
    from meshkit.launching.launch import LaunchPlan
    from meshkit.launching.stores import node_addresses

    settings = LaunchSettings(nproc_per_node=2)
    plan = LaunchPlan(settings, log_dir=tmp_path / "run", config_file=None)
    env = plan.worker_env(node_addresses(settings))
    assert any(name.startswith("MESHKIT_") for name in env) and any("LOG" in name for name in env)
    assert resolve(env=env).config.launch.nproc_per_node == 1  # (the workers' own view: flags only from the env)
