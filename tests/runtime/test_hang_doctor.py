"""The hang doctor: a stalled collective ends the job while the stalled rank is still stalled, naming it;
work done on the main process alone does not trip the timeout when it uses `main_process_work`."""

from __future__ import annotations

import pytest

from tests.helpers.cli import meshkit

pytestmark = pytest.mark.slow  # launcher jobs that wait out a collective timeout
TIMEOUT_S = 4

STALLING_RANK = """
import time
import torch
from meshkit import Engine
from meshkit.models.gpt import lm_loss
from tests.helpers.training import split, tiny_gpt, token_batches

engine = Engine(seed=0)
model = tiny_gpt()
model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lm_loss)
for step, batch in enumerate(token_batches(4, 2)):
    if step == 2 and engine.process_index == 1:
        print(f"STALL AT {time.time()}", flush=True)
        time.sleep(100)  # e.g. a data loader stuck on a network share
        print("WOKE", flush=True)
    engine.train_step(split(batch[engine.process_index : engine.process_index + 1]))
engine.end()
"""

MAIN_PROCESS_WORK = """
import sys, time
import torch
from meshkit import Engine

engine = Engine()
with engine.main_process_work(timeout_s=120) as is_main:
    if is_main:
        time.sleep({sleep})  # evaluation, saving, uploading: longer than collective_timeout_s
total = engine.reduce(torch.ones(1), op="sum")
print(f"DONE rank {{engine.process_index}} total {{total.item():g}}", flush=True)
engine.end()
"""

BARE_MAIN_PROCESS_WORK = """
import time
from meshkit import Engine

engine = Engine()
if engine.is_main_process:
    time.sleep(30)
engine.wait_for_everyone()  # the other ranks time out here
engine.end()
"""


def _launch(tmp_path, source: str):
    script = tmp_path / "job.py"
    script.write_text(source)
    return meshkit("launch", "--nproc-per-node", "2", "--set", f"collective_timeout_s={TIMEOUT_S}", str(script))


def test_a_stalled_rank_ends_the_job_while_it_is_stalled_and_is_named(tmp_path) -> None:
    proc = _launch(tmp_path, STALLING_RANK)
    assert proc.returncode != 0
    assert "STALL AT" in proc.stdout and "WOKE" not in proc.stdout  # ended at the timeout, not when rank 1 woke
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("meshkit launch: rank 0") and "HangError" in summary
    assert f"waited {TIMEOUT_S}." in summary and "in train_step at step 2" in summary
    assert "not there: rank 1 (outside meshkit calls since train_step ended at step 2" in summary


def test_main_process_work_waits_beyond_the_collective_timeout(tmp_path) -> None:
    proc = _launch(tmp_path, MAIN_PROCESS_WORK.format(sleep=TIMEOUT_S + 3))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DONE rank 0 total 2" in proc.stdout and "DONE rank 1 total 2" in proc.stdout


def test_main_process_work_without_the_pattern_is_reported_as_a_hang_of_the_main_rank(tmp_path) -> None:
    proc = _launch(tmp_path, BARE_MAIN_PROCESS_WORK)
    assert proc.returncode != 0
    summary = proc.stderr.strip().splitlines()[-1]
    assert "rank 1" in summary and "in wait_for_everyone at step 0" in summary
    assert "not there: rank 0 (outside meshkit calls since it started" in summary
