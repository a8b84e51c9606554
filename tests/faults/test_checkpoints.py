"""Checkpoint faults: overlapping asynchronous saves, foreign files, no usable checkpoint, a full disk, and a
step saved twice. No fault may lose a committed checkpoint."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import warnings

import pytest

from meshkit.checkpoint.directory import CheckpointReplacedWarning, commit, partial_dir
from meshkit.checkpoint.storage import verify
from tests.faults.recipe import summary, tiny_recipe
from tests.helpers.cli import meshkit

TRAIN_AND_SAVE = """
import errno, os, sys, time
import torch
import meshkit.checkpoint.session as session
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from meshkit import Engine
from meshkit.checkpoint.storage import CheckpointError

class FaultyWriter(HuggingFaceStorageWriter):
    def write_data(self, plan, planner):  # runs in the background thread of an asynchronous save
        if os.environ["FAULT"] == "slow":
            time.sleep(0.5)  # slower than a training step: the next save arrives while this one is in flight
        elif os.environ["FAULT"] == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write_data(plan, planner)

session.writer = lambda directory: FaultyWriter(str(directory), save_distributed=True)
engine = Engine(checkpoint={"every_steps": 1, "async_save": True, "dir": sys.argv[1], "keep_last": 2})
model = torch.nn.Linear(256, 256)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = engine.prepare(model, optimizer)
try:
    for step in range(4):
        engine.backward(model(torch.randn(4, 256)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        engine.save_checkpoint()
    engine.wait_for_checkpoint()
except CheckpointError as err:
    sys.stdout.write(f"SAVE FAILED rank {engine.process_index}: {err}\\n")  # one write: ranks never interleave
    sys.stdout.flush()
engine.end()
"""


def _train_and_save(tmp_path, fault: str, ckpt) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(TRAIN_AND_SAVE)
    return meshkit("launch", "--nproc-per-node", "2", str(script), str(ckpt), env={"FAULT": fault}, timeout=120)


def test_saves_that_outlast_a_step_queue_up_and_all_commit(tmp_path) -> None:
    proc = _train_and_save(tmp_path, "slow", tmp_path / "ckpt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SAVE FAILED" not in proc.stdout
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["latest", "step-000003", "step-000004"]
    for name in kept[1:]:
        verify(tmp_path / "ckpt" / name)


@contextlib.contextmanager
def _small_filesystem(path):
    """A 64 KiB tmpfs (root only); None when it cannot be mounted here."""
    path.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None
    if mounted:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True)
        mounted = result.returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_an_asynchronous_save_on_a_full_disk_names_the_cause(tmp_path) -> None:
    with _small_filesystem(tmp_path / "small") as mounted:
        if not mounted:
            print("no tmpfs mount here (needs root): the writer raises ENOSPC itself")
        proc = _train_and_save(tmp_path, "none" if mounted else "enospc", tmp_path / "small")
    failed = [line for line in proc.stdout.splitlines() if line.startswith("SAVE FAILED")]
    assert len(failed) == 2, proc.stdout + proc.stderr[-3000:]  # every rank learns of it
    for line in failed:
        assert "No space left on device" in line and "nothing was committed" in line
        assert "dict_keys" not in line and len(line) < 600


def test_foreign_files_are_ignored_and_unusable_checkpoints_stop_the_run(tmp_path) -> None:
    config = tiny_recipe(tmp_path, every_steps=2)
    first = meshkit("train", str(config), "launch.nproc_per_node=1", timeout=180)  # resumed at world 2 below
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    for step_dir in ckpt.glob("step-*"):  # what NFS and editors leave behind
        (step_dir / ".nfs0000000001234").write_text("x")
        (step_dir / "meta.json~").write_text("x")

    resumed = meshkit("train", str(config), "train.steps=6", timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(tmp_path)["resumed_at_step"] == 4
    assert "ignoring files it did not write: .nfs0000000001234, meta.json~" in resumed.stderr

    for step_dir in ckpt.glob("step-*"):
        shard = next(step_dir.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:-8] + b"damaged!")
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.glob("step-*/*")}
    refused = meshkit("train", str(config), "train.steps=8", "launch.nproc_per_node=1", timeout=180)
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert "none of the 3 checkpoints under" in last and "does not match its checksum" in last, last
    assert "checkpoint.resume=never" in last
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.glob("step-*/*")} == before  # nothing overwritten


def test_saving_a_step_that_exists_keeps_the_old_directory(tmp_path) -> None:
    old = tmp_path / "step-000002"
    old.mkdir()
    (old / "meta.json").write_text("old")
    new = partial_dir(tmp_path, 2)
    new.mkdir()
    (new / "meta.json").write_text("new")
    with pytest.warns(CheckpointReplacedWarning, match="kept as step-000002.replaced"):
        commit(new, tmp_path, 2, keep_last=1)
    assert (tmp_path / "step-000002" / "meta.json").read_text() == "new"
    assert (tmp_path / "step-000002.replaced" / "meta.json").read_text() == "old"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointReplacedWarning)
        again = partial_dir(tmp_path, 2)
        again.mkdir()
        commit(again, tmp_path, 2, keep_last=1)
    assert (tmp_path / "step-000002.replaced-2").is_dir()
