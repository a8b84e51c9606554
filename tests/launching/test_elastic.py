"""Elastic jobs (`--nnodes MIN:MAX`): after a node is lost the job goes on with fewer ranks, resharded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import ROOT, kill_all, kill_tree, meshkit
from tests.helpers.distributed import free_port
from tests.multinode.hosts import covered_on_two_hosts

STEPS = 30


def _node(node_rank: int, port: int, config: Path, run_dir: Path) -> subprocess.Popen:
    command = [
        *(sys.executable, "-m", "meshkit.cli", "launch", "--nnodes", "1:2", "--node-rank", str(node_rank)),
        *("--nproc-per-node", "1", "--master-port", str(port), "--max-restarts", "3", "--rdzv-timeout", "60"),
        *("--set", "launch.rdzv_last_call_s=1", "-m", "meshkit.recipes.train", str(config), f"logging.dir={run_dir}"),
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
@covered_on_two_hosts("elastic shrink runs on two simulated hosts (tests/multinode)")
def test_losing_a_node_continues_on_fewer_ranks_from_the_last_checkpoint(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "checkpoint": {"every_steps": 3, "resume": "auto", "dir": str(tmp_path / "ckpt")},
                "model": {"dim": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 32},
                "train": {"steps": STEPS, "micro_batch_size": 2, "seq_len": 32, "log_every": 10},
            }
        )
    )
    port = free_port()
    node0 = _node(0, port, config, tmp_path / "node0")
    time.sleep(1.0)  # node 0 hosts the rendezvous
    node1 = _node(1, port, config, tmp_path / "node1")
    try:
        latest = tmp_path / "ckpt" / "latest"
        deadline = time.monotonic() + 120
        while not latest.exists() and node0.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert latest.exists(), "no checkpoint was committed before the job ended"
        kill_tree(node1.pid)  # node 1 is lost: its agent and worker die at once
        out, err = node0.communicate(timeout=180)
    finally:
        kill_all(node0, node1)
    assert node0.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == STEPS
    assert 0 < summary["resumed_at_step"] < STEPS
    assert "meshkit: resumed from" in out + err


def test_nnodes_must_be_a_count_or_min_max(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('never runs')\n")
    proc = meshkit("launch", "--nnodes", "two", str(script))
    assert proc.returncode == 2 and "--nnodes two: give a node count (2) or MIN:MAX" in proc.stderr
    proc = meshkit("launch", "--nnodes", "3:2", str(script))
    assert proc.returncode == 2 and "min_nnodes=3 must not exceed nnodes=2" in proc.stderr


@pytest.fixture(autouse=True)
def _no_stray_run_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MESHKIT_LOGGING__DIR", raising=False)
