"""`make gpu-check` (bench/gpu_check.py) runs on a CPU too: every row that can run does, on a tiny shape, and the
rows that need a GPU say why they are skipped — so the script a lent GPU runs at once stays alive in CI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.world  # (its rows start one-process worlds)
def test_the_gpu_check_passes_on_a_cpu_and_says_why_gpu_rows_are_skipped(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"engine", "whole compile", "full recompute", "torch", "fused loss", "finetune", "estimator",
                         "fsdp2", "fp8"}  # fmt: skip
    assert not [name for name, row in rows.items() if "error" in row]
    assert "fp8 tensor cores" in rows["fp8"]["skipped"]
    assert rows["engine"]["tokens_per_s"] > 0 and rows["fsdp2"]["tokens_per_s"] > 0
    assert rows["fused loss"]["loss_relative_error"] < 1e-6 and rows["fused loss"]["grad_relative_error"] < 1e-4
    assert rows["finetune"]["fused_loss"] == pytest.approx(rows["finetune"]["plain_loss"], rel=1e-5)
    assert rows["estimator"]["predicted_gb"] > 0 and "GPU only" in rows["estimator"]["note"]
    assert rows["estimator"]["full_predicted_gb"] < rows["estimator"]["predicted_gb"]
    engine = rows["engine"]  # where it ran, and dynamo's counts (compile is off on the CPU shape)
    assert (engine["device"], engine["backend"], engine["compile"], engine["graphs"]) == ("cpu", "gloo", "off", 0)
    assert "compile is off" in rows["whole compile"]["skipped"] and rows["full recompute"]["tokens_per_s"] > 0
