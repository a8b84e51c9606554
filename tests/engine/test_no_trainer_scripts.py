"""transformers' `run_*_no_trainer.py` scripts in their own shape (`tests/helpers/no_trainer_script.py`: causal LM,
masked LM, sequence and token classification, multiple choice), at world 2 with only the Accelerator's import
changed: Accelerate's logger works under meshkit's Accelerator, the facts a script branches on, the metrics
(per-batch, over a padded last batch) and the final weights equal Accelerate's, and a run resumed mid-epoch or at
an epoch's end ends with the uninterrupted run's weights (the loader's `len()` is the epoch's after `load_state`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate (a test dependency) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from tests.helpers.cli import ROOT, meshkit  # noqa: E402

SCRIPT = ROOT / "tests" / "helpers" / "no_trainer_script.py"


def _meshkit(out: Path, task: str, resume: str = "none") -> str:
    done = meshkit("launch", "--nproc-per-node", "2", str(SCRIPT), "meshkit", str(out), resume, "0", task,
                   timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _accelerate(out: Path, task: str) -> None:
    import subprocess

    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), "accelerate",
               str(out), "none", "0", task]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], tolerance: float) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("task", "resumes"),
    # Resumed mid-epoch (step_2) and at an epoch's end (step_4 by step, epoch_0 by epoch). The masked LM's collator
    # draws from the generator: resumed mid-epoch, its masks must be the uninterrupted run's (its step_4 checkpoint
    # precedes the evaluation's draws, so its epoch's end is `epoch_0`; Accelerate's own resumed masked-LM runs end
    # 0.04 away from its uninterrupted one: its loader draws ahead of the checkpoint).
    # The suite keeps the three shapes whose metrics differ in kind (per-batch perplexity, sampled masking, gathered
    # predictions) and each resume once: `make test-full` also resumes the masked LM at its epoch's end and the
    # classifier at both, and runs NER and SWAG (per-token and multiple-choice metrics).
    [
        ("clm", ("step_2", "step_4")),
        ("mlm", ("step_2",)),
        ("cls", ()),
        pytest.param("mlm", ("epoch_0",), marks=pytest.mark.sweep),
        pytest.param("cls", ("step_2", "step_4"), marks=pytest.mark.sweep),
        pytest.param("ner", (), marks=pytest.mark.sweep),
        pytest.param("swag", (), marks=pytest.mark.sweep),
    ],  # fmt: skip
)
def test_a_no_trainer_script_runs_logs_and_resumes_as_under_accelerate(tmp_path, task, resumes) -> None:
    ours, theirs = tmp_path / "meshkit", tmp_path / "accelerate"
    ours.mkdir()
    theirs.mkdir()
    output = _meshkit(ours, task)
    assert "[RANK 0] Distributed environment: MULTI_CPU" in output and "[RANK 1] Distributed environment" in output
    _accelerate(theirs, task)
    for rank in (0, 1):
        facts = json.loads((ours / f"facts-{rank}.json").read_text())
        assert facts == json.loads((theirs / f"facts-{rank}.json").read_text()) and facts["is_multi_cpu"]
    metrics = json.loads((ours / "metrics-none.json").read_text())
    reference = json.loads((theirs / "metrics-none.json").read_text())
    assert [m["steps"] for m in metrics] == [m["steps"] for m in reference] == [4, 8]
    for mine, accelerate in zip(metrics, reference, strict=True):  # (perplexity, or accuracy over all 7 rows)
        assert mine["metric"] == pytest.approx(accelerate["metric"], rel=1e-4)
    whole = _weights(ours / "final-none")
    _close(whole, _weights(theirs / "final-none"), 1e-4)
    for resume in resumes:
        _meshkit(ours, task, resume)
        _close(_weights(ours / f"final-{resume}"), whole, 1e-6)
        resumed = json.loads((ours / f"metrics-{resume}.json").read_text())
        assert resumed[-1] == pytest.approx(metrics[-1]), resume


def test_meshkits_get_logger_logs_as_accelerates(caplog) -> None:
    import logging

    from meshkit.logging import get_logger

    logger = get_logger("meshkit-test", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="meshkit-test"):
        logger.info("on the main process")
        logger.info("on every process", main_process_only=False)
        logger.info("in turn", in_order=True)
        logger.warning_once("said once")
        logger.warning_once("said once")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["[RANK 0] on the main process", "[RANK 0] on every process", "[RANK 0] in turn",
                        "[RANK 0] said once"]  # fmt: skip
