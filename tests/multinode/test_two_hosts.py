"""Jobs across two hosts (network namespaces joined by a veth pair, each running `meshkit launch --nnodes 2`):
a normal run (one node arriving late) ends at the one-process weights, a missing node fails within the rendezvous
timeout naming what is missing, a killed worker is restarted from the last checkpoint, a lost node stops the
job naming it, and an elastic job shrinks to the node that is left."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers.cli import ROOT, kill_tree
from tests.multinode.hosts import TwoHosts, output_of
from tests.multinode.job import STEPS

JOB = ROOT / "tests" / "multinode" / "job.py"
PORT = "29500"  # each host has its own port space


def write_config(tmp_path: Path, **extra: object) -> Path:
    config = {"checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 2, "resume": "auto"}, **extra}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_node(hosts: TwoHosts, node: int, config: Path, out: Path, *flags: str, env=None) -> subprocess.Popen:
    return hosts.start(
        node,
        *("launch", "--nproc-per-node", "1", "--master-addr", hosts.addresses[0], "--master-port", PORT),
        *("--node-rank", str(node), "--config-file", str(config), *flags, str(JOB), str(out)),
        env=env,
    )


def steps(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same job as one plain process."""
    out = tmp_path_factory.mktemp("reference")
    subprocess.run([sys.executable, str(JOB), str(out)], cwd=ROOT, check=True, timeout=120, capture_output=True)
    return [row["loss"] for row in steps(out)], load_file(out / "weights.safetensors")


def assert_same_run(out: Path, reference) -> None:
    losses, weights = reference
    by_step = {row["step"]: row["loss"] for row in steps(out)}  # a restarted step is logged again: the last counts
    assert sorted(by_step) == list(range(len(losses)))
    assert [by_step[step] for step in sorted(by_step)] == pytest.approx(losses, rel=1e-5)
    got = load_file(out / "weights.safetensors")
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def finish(*nodes: subprocess.Popen, timeout: float = 120) -> list[tuple[int, str, str]]:
    return [output_of(node, timeout) for node in nodes]


def test_two_hosts_train_to_the_one_process_weights_waiting_for_a_late_node(hosts, tmp_path, reference) -> None:
    config = write_config(tmp_path)
    node0 = start_node(hosts, 0, config, tmp_path, "--nnodes", "2", "--rdzv-timeout", "60")
    time.sleep(6)
    assert node0.poll() is None, "node 0 gave up before the rendezvous timeout"
    node1 = start_node(hosts, 1, config, tmp_path, "--nnodes", "2", "--rdzv-timeout", "60")
    for code, _, err in finish(node0, node1):
        assert code == 0, err
    assert {row["world"] for row in steps(tmp_path)} == {2}
    assert_same_run(tmp_path, reference)


def test_a_missing_node_fails_within_the_rendezvous_timeout_naming_it(hosts, tmp_path) -> None:
    config = write_config(tmp_path)
    node0 = start_node(hosts, 0, config, tmp_path, "--nnodes", "2", "--rdzv-timeout", "6")
    code, _, err = output_of(node0, timeout=60)  # a hang fails here
    assert code != 0
    assert "timed out after 6s: expected 2 nodes, 1 alive" in err, err
    assert steps(tmp_path) == []


@pytest.mark.sweep  # (restarts: one host in tests/checkpoint/test_checkpoint_recovery.py, Ray in test_ray_cluster)
def test_a_killed_worker_restarts_every_node_from_the_last_checkpoint(hosts, tmp_path, reference) -> None:
    config = write_config(tmp_path)
    env = {"JOB_KILL": "1:0:5"}  # node 1's worker dies by SIGKILL at step 5 of the first attempt
    flags = ("--nnodes", "2", "--rdzv-timeout", "60", "--max-restarts", "1")
    nodes = [start_node(hosts, node, config, tmp_path, *flags, env=env) for node in (0, 1)]
    for code, _, err in finish(*nodes):
        assert code == 0, err
    rows = steps(tmp_path)
    assert [row["step"] for row in rows if row["attempt"] == 0] == [0, 1, 2, 3, 4]
    assert [row["step"] for row in rows if row["attempt"] == 1][0] == 4  # resumed from step-000004
    assert_same_run(tmp_path, reference)


def wait_for_checkpoint(tmp_path: Path, *nodes: subprocess.Popen) -> None:
    # the first checkpoint comes before any node ends (pytest-timeout is the hang guard)
    while not (tmp_path / "ckpt" / "latest").exists():
        assert all(node.poll() is None for node in nodes), "a node ended before the first checkpoint"
        time.sleep(0.05)


def test_a_lost_node_stops_the_job_naming_it(hosts, tmp_path) -> None:
    config = write_config(tmp_path, collective_timeout_s=6)
    env = {"JOB_STEP_SLEEP": "0.5"}
    flags = ("--nnodes", "2", "--rdzv-timeout", "6", "--max-restarts", "1")
    node0, node1 = (start_node(hosts, node, config, tmp_path, *flags, env=env) for node in (0, 1))
    wait_for_checkpoint(tmp_path, node0, node1)
    hosts.unplug(1)  # the machine is gone: no closed connections, only silence
    kill_tree(node1.pid)
    code, _, err = output_of(node0, timeout=120)  # a hang fails here
    assert code != 0
    assert "node 1" in err, err


def test_an_elastic_job_goes_on_with_the_node_that_is_left(hosts, tmp_path) -> None:
    config = write_config(tmp_path, collective_timeout_s=6, launch={"rdzv_last_call_s": 1})
    env = {"JOB_STEP_SLEEP": "0.5"}
    flags = ("--nnodes", "1:2", "--rdzv-timeout", "30", "--max-restarts", "2")
    node0, node1 = (start_node(hosts, node, config, tmp_path, *flags, env=env) for node in (0, 1))
    wait_for_checkpoint(tmp_path, node0, node1)
    hosts.unplug(1)
    kill_tree(node1.pid)
    code, _, err = output_of(node0, timeout=150)
    assert code == 0, err
    rows = steps(tmp_path)
    assert rows[0]["world"] == 2 and rows[-1]["world"] == 1 and rows[-1]["step"] == STEPS - 1
    resumed = next(row for row in rows if row["world"] == 1)
    assert resumed["step"] % 2 == 0 and resumed["step"] > 0  # from a checkpoint (every 2 steps), not from scratch
    assert (tmp_path / "weights.safetensors").exists()
