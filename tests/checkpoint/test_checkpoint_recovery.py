"""Recovery end to end: a worker killed mid-run is restarted by the launcher and resumes from `latest`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import ROOT, descendants
from tests.helpers.distributed import run_world
from tests.helpers.training import train_recipe

pytestmark = pytest.mark.slow  # killed and restarted launcher jobs

STEPS = 30


def _config(tmp_path: Path, name: str) -> Path:
    text = tmp_path / "corpus.txt"
    if not text.exists():  # 40 windows of 32 tokens: 10 steps per epoch at 2 ranks x 2, so the run spans 3 epochs
        text.write_text(("the quick brown fox jumps over the lazy dog; " * 40)[: 40 * 32 + 1])
    config = {
        "launch": {"nproc_per_node": 2},
        "checkpoint": {"every_steps": 3, "keep_last": 2, "resume": "auto"},
        "model": {"dim": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 32},
        "train": {"steps": STEPS, "micro_batch_size": 2, "seq_len": 32, "dataset": str(text), "log_every": 10},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _launch(config: Path) -> subprocess.Popen:
    run_dir = config.with_suffix("")  # an argument: it outranks the test's MESHKIT_LOGGING__DIR
    command = [sys.executable, "-m", "meshkit.cli", "launch", "--nproc-per-node", "2", "--max-restarts", "1"]
    return subprocess.Popen(
        [*command, "-m", "meshkit.recipes.train", str(config), f"logging.dir={run_dir}"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _worker(launcher: int, rank: int) -> int | None:
    for pid in descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RESTART_COUNT=0" in environ:
            return pid
    return None


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the job did not finish within {timeout}s:\n{err[-3000:]}")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path) -> None:
    # the uninterrupted run: what the launcher's workers run, in a world of the same size
    whole = run_world(train_recipe, 2, str(_config(tmp_path, "whole")), [f"logging.dir={tmp_path / 'whole'}"],
                      timeout=240)[0]  # fmt: skip

    job = _launch(_config(tmp_path, "killed"))
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    while not latest.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = _worker(job.pid, rank=1)
    assert victim is not None and latest.exists(), "no checkpoint was committed before the job ended"
    os.kill(victim, signal.SIGKILL)
    out, err = _finish(job, 240)
    assert job.returncode == 0, err[-3000:]
    killed = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert 0 < killed["resumed_at_step"] < STEPS, "the restarted workers did not resume from a checkpoint"
    assert "meshkit: resumed from" in out + err
    assert killed["params_sha256"] == whole["params_sha256"]
    assert killed["final_loss"] == whole["final_loss"]
