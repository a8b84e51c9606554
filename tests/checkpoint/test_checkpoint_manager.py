"""The checkpoint root: periodic saves, `latest`, pruning, integrity, and what happens on bad input."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from meshkit import Engine
from meshkit.checkpoint.directory import CheckpointSkippedWarning, latest
from meshkit.checkpoint.storage import CheckpointError, verify
from meshkit.models.gpt import GPT, GPTConfig, lm_loss
from tests.helpers.cli import ROOT, meshkit
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.training import TINY, split, token_batches


def _engine(root: Path, model_config: GPTConfig = TINY, **checkpoint) -> tuple[Engine, torch.optim.Optimizer]:
    engine = Engine(seed=0, checkpoint={"dir": str(root), **checkpoint})
    torch.manual_seed(0)
    model = GPT(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, optimizer = engine.prepare(model, optimizer, loss_fn=lm_loss)
    return engine, optimizer


def _train(engine: Engine, steps: int) -> None:
    for batch in token_batches(engine.step + steps, 2)[engine.step :]:
        engine.train_step(split(batch))
        engine.save_checkpoint(extra={"step": engine.step})


def test_periodic_saves_move_latest_and_keep_the_newest(tmp_path) -> None:
    engine, _ = _engine(tmp_path, every_steps=2, keep_last=2)
    with engine:
        _train(engine, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004", "step-000006"]
    assert (tmp_path / "latest").read_text().strip() == "step-000006"
    verify(tmp_path / "step-000006")


def test_a_truncated_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path) -> None:
    engine, _ = _engine(tmp_path, every_steps=2, keep_last=3)
    with engine:
        _train(engine, 4)
    newest = tmp_path / "step-000004"
    victim = next(newest.glob("*.safetensors"))
    os.truncate(victim, victim.stat().st_size // 2)
    engine, _ = _engine(tmp_path, resume="auto")
    with engine, pytest.warns(CheckpointSkippedWarning, match=r"step-000004.*has \d+ bytes, the manifest says"):
        extra = engine.resume()
        assert engine.step == 2 and extra == {"step": 2}


def test_load_state_refuses_files_that_do_not_match_the_manifest(tmp_path) -> None:
    engine, _ = _engine(tmp_path)
    with engine:
        _train(engine, 1)
        saved = engine.save_state(tmp_path / "one")
        data = next(saved.glob("*.safetensors"))
        blob = bytearray(data.read_bytes())
        blob[-1] ^= 0xFF  # same size, different bytes
        data.write_bytes(bytes(blob))
        with pytest.raises(CheckpointError, match=r"does not match its checksum"):
            engine.load_state(saved)


MANIFEST_DAMAGE = {
    "a key of an entry": lambda text: text.replace('"sha256"', '"sh`256"', 1),
    "a size's key": lambda text: text.replace('"size"', '"rize"', 1),
    "a digit of a checksum": lambda text: text,  # (done in the test: one digit of meta.json's entry)
    "the files table's key": lambda text: text.replace('"files"', '"filez"', 1),
    "its own checksum's key": lambda text: text.replace('"checksum"', '"checksun"', 1),
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_a_damaged_manifest_is_refused_in_one_line_naming_the_manifest(tmp_path, damage) -> None:
    engine, _ = _engine(tmp_path)
    with engine:
        _train(engine, 1)
        saved = engine.save_state(tmp_path / "one")
        manifest = saved / "manifest.json"
        text = manifest.read_text()
        if damage == "a digit of a checksum":  # one hex digit of meta.json's checksum changed: meta.json is fine
            start = text.index('"sha256": "', text.index('"meta.json"')) + len('"sha256": "')
            text = text[:start] + ("0" if text[start] != "0" else "1") + text[start + 1 :]
        else:
            text = MANIFEST_DAMAGE[damage](text)
        assert text != manifest.read_text()
        manifest.write_text(text)
        with pytest.raises(CheckpointError) as refused:
            engine.load_state(saved)
    message = str(refused.value)
    assert "manifest.json is damaged" in message and "\n" not in message, message


def test_a_rank_record_without_its_field_is_refused_naming_it(tmp_path) -> None:
    from meshkit.checkpoint.storage import read_record

    (tmp_path / "rank-00000.json").write_text('{"rnq": {}}')
    with pytest.raises(CheckpointError, match=r"rank-00000.json is damaged: it has no 'rng'"):
        read_record(tmp_path, "rank-00000.json", ("rng",))


def test_resume_from_a_path_that_does_not_exist_names_it(tmp_path) -> None:
    missing = tmp_path / "nowhere" / "step-000100"
    engine, _ = _engine(tmp_path, resume=str(missing))
    with engine, pytest.raises(CheckpointError, match=rf"checkpoint.resume={missing}: no such checkpoint directory"):
        engine.resume()
    config = tmp_path / "run.yaml"
    config.write_text(f"checkpoint:\n  resume: {missing}\n")
    proc = meshkit("train", str(config), "train.steps=1", f"logging.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2 and f"checkpoint.resume={missing}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_checkpoint_of_another_model_lists_the_mismatched_keys_and_shapes(tmp_path) -> None:
    engine, _ = _engine(tmp_path)
    with engine:
        _train(engine, 1)
        engine.save_state(tmp_path / "small")
    wider = GPTConfig(**{**TINY.model_dump(), "dim": 48})
    engine, _ = _engine(tmp_path, model_config=wider)
    with (
        engine,
        pytest.raises(
            CheckpointError, match=r"does not match this model: .*\(64, 32\) in the checkpoint vs \(64, 48\) here"
        ),
    ):
        engine.load_state(tmp_path / "small")


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """Writes beyond `limit` bytes fail with EFBIG (SIGXFSZ ignored), as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_fails_the_save_loudly_and_keeps_the_previous_checkpoint(tmp_path) -> None:
    engine, _ = _engine(tmp_path, every_steps=1)
    with engine:
        _train(engine, 1)
        largest = max(p.stat().st_size for p in (tmp_path / "step-000001").iterdir())
        with _file_size_limit(largest // 2), pytest.raises(CheckpointError, match=r"step-000002.*failed"):
            _train(engine, 1)
    assert (tmp_path / "latest").read_text().strip() == "step-000001"
    assert latest(tmp_path) == tmp_path / "step-000001"
    assert not list(tmp_path.glob(".step-*"))  # the half-written save is gone


KILLED_MID_SAVE = """
import os, signal, sys
import meshkit.checkpoint.session as session
from tests.checkpoint.test_checkpoint_manager import _engine, _train
from pathlib import Path

engine, _ = _engine(Path(sys.argv[1]), every_steps=2)
_train(engine, 2)
def die(*args):  # every tensor file written, nothing committed yet
    os.kill(os.getpid(), signal.SIGKILL)
session.write_manifest = die
_train(engine, 2)
"""


def test_a_kill_mid_save_leaves_the_previous_checkpoint_latest(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_MID_SAVE), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / ".step-000004.partial").is_dir()  # died mid-save
    assert (tmp_path / "latest").read_text().strip() == "step-000002"
    engine, _ = _engine(tmp_path, every_steps=2, resume="auto")
    with engine:
        assert engine.resume() == {"step": 2} and engine.step == 2
        _train(engine, 2)
    assert not (tmp_path / ".step-000004.partial").exists()
    assert (tmp_path / "latest").read_text().strip() == "step-000004"


def test_random_states_step_and_extra_come_back(tmp_path) -> None:
    engine, _ = _engine(tmp_path)
    with engine:
        _train(engine, 2)
        engine.save_state(tmp_path / "state", extra={"note": "two steps"})
        expected_torch, expected_python = torch.rand(3), random.random()
    engine, _ = _engine(tmp_path)
    with engine:
        torch.rand(5), random.random()  # move the generators on
        assert engine.load_state(tmp_path / "state") == {"note": "two steps"}
        assert engine.step == 2
        assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_python


def save_with_a_failing_rank(rank: int, root: str) -> str:
    """Rank 1 cannot write its files: every rank must fail the save alike (no hang), and the next one works."""
    import torch.distributed as dist

    import meshkit.checkpoint.session as session

    dist.init_process_group("gloo")
    engine, _ = _engine(Path(root))
    _train(engine, 1)
    original = session.write_json

    def disk_full(path, data) -> None:  # noqa: ANN001
        raise OSError(28, "No space left on device")

    if rank == 1:
        session.write_json = disk_full
    try:
        engine.save_checkpoint(force=True)
        outcome = "saved"
    except CheckpointError as err:
        outcome = str(err)
    session.write_json = original
    engine.save_checkpoint(force=True)
    engine.end()
    leave_world()
    return outcome


def test_a_save_failing_on_one_rank_fails_on_every_rank_and_the_next_save_works(tmp_path) -> None:
    outcomes = run_world(save_with_a_failing_rank, 2, str(tmp_path), timeout=120)
    for outcome in outcomes:
        assert "rank 1: OSError: [Errno 28] No space left on device" in outcome and "nothing was committed" in outcome
    assert (tmp_path / "latest").read_text().strip() == "step-000001"
    verify(tmp_path / "step-000001")
