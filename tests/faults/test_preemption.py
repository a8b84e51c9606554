"""Graceful preemption: SIGTERM (to the launcher, as Kubernetes sends it, or to the workers, as SLURM may)
makes every rank checkpoint at the same step and exit 75; the same command then resumes from there."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.faults.helpers import background_meshkit, needs_proc, wait_for
from tests.faults.recipe import summary, tiny_recipe
from tests.helpers.cli import descendants, meshkit


@needs_proc
@pytest.mark.parametrize("target", ["launcher", "workers"])
def test_sigterm_checkpoints_every_rank_at_one_step_and_the_rerun_resumes(tmp_path, target) -> None:
    config = tiny_recipe(tmp_path, every_steps=1000)  # no periodic save would happen before the signal
    metrics = tmp_path / "run" / "metrics.jsonl"
    with background_meshkit("train", str(config), "train.steps=100000") as launcher:
        wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, 120, "the first training step")
        pids = [launcher.pid] if target == "launcher" else descendants(launcher.pid)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 75, err[-3000:]
    found = re.search(r"preempted by SIGTERM: checkpoint (\S+) committed at step (\d+)", err)
    assert found, err[-3000:]
    step = int(found.group(2))
    assert (tmp_path / "ckpt" / f"step-{step:06d}").is_dir() and step > 0
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step-{step:06d}"
    if target == "workers":
        return  # resuming is the same as after the launcher's SIGTERM

    resumed = meshkit("train", str(config), f"train.steps={step + 2}", timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(tmp_path)["resumed_at_step"] == step


def test_a_loop_that_checkpoints_every_step_can_take_the_signal_from_its_first_step() -> None:
    """The recipes arm the watch before their first step (the first save_checkpoint() would, after it): a signal
    that comes while step 1 runs is noted, not the process's end."""
    from meshkit import Engine

    engine = Engine()
    try:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and not engine.ctx.preemption.received
        engine.checkpoints.arm_preemption()
        os.kill(os.getpid(), signal.SIGTERM)  # noted by the watch; the default action would end this test
        assert engine.ctx.preemption.received
    finally:
        engine.end()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # disarmed again by end()


@needs_proc
def test_ctrl_c_checkpoints_like_sigterm_in_one_line_and_exits_130(tmp_path) -> None:
    """Ctrl-C sends SIGINT to the terminal's whole process group: the launcher and every worker."""
    config = tiny_recipe(tmp_path, every_steps=1000)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with background_meshkit("train", str(config), "train.steps=100000") as launcher:
        wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, 120, "the first training step")
        os.killpg(launcher.pid, signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err[-3000:]
    found = re.search(r"interrupted \(SIGINT\): checkpoint (\S+) committed at step (\d+)", err)
    assert found, err[-3000:]
    assert (tmp_path / "ckpt" / f"step-{int(found.group(2)):06d}").is_dir()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


@needs_proc
def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path) -> None:
    config = tiny_recipe(tmp_path, every_steps=1000)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with background_meshkit("train", str(config), "train.steps=100000", "train.log_every=1") as launcher:
        wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, 120, "the first training step")
        os.killpg(launcher.pid, signal.SIGINT)
        os.killpg(launcher.pid, signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
