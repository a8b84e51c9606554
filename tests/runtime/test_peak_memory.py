"""Under `meshkit launch`, a CPU rank's peak resident memory stops rising once every tensor of a step exists
(ZeRO-3, world 2, 8 × Linear(2048, 2048), SGD momentum). The momentum buffers are created by step 1's optimizer
step, so step 2 is the first whole step: from there, glibc's own settings let the peak climb ~25 % in 6 steps
(measured), either allocator meshkit starts its workers on holds it (`runtime/host_memory.py`): tcmalloc where
installed, glibc's fixed mmap threshold on huge pages otherwise. glibc's holds it exactly (each block of 4 MB or
more mapped on its own); tcmalloc, which caches freed blocks by size, settles within a step or three at most a
block or two higher (measured here: +0–24 MB of 610 MB by step 6; at world 4 on 100 M parameters within 2 %)."""

from __future__ import annotations

import json

import pytest

from meshkit.runtime.host_memory import THP_SETTING, find_tcmalloc
from tests.helpers.cli import meshkit

pytestmark = pytest.mark.slow  # memory over whole runs

SCRIPT = """
import ctypes, json, sys, torch
from meshkit import Engine
from meshkit.runtime.memory import peak_rss_bytes
engine = Engine(zero_stage=3, dp_shard=-1, dp_replicate=1)
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(8)))
model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
peaks = []
for _ in range(8):
    engine.backward(model(torch.randn(8, 2048)).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    peaks.append(peak_rss_bytes())
on_tcmalloc = hasattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory")
sys.stdout.write("PEAKS " + json.dumps({"rank": engine.process_index, "peaks": peaks, "tcmalloc": on_tcmalloc}) + "\\n")
sys.stdout.flush()
engine.end()
"""


def _peaks(tmp_path, *settings: str) -> list[dict]:
    script = tmp_path / "peaks.py"
    script.write_text(SCRIPT)
    proc = meshkit("launch", "--nproc-per-node", "2", *settings, str(script), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("PEAKS ")]
    return sorted(lines, key=lambda entry: entry["rank"])


NO_HUGE_PAGES = not THP_SETTING.is_file() or "[never]" in THP_SETTING.read_text()


@pytest.mark.parametrize(
    "allocator",
    [
        pytest.param(
            "glibc",
            marks=pytest.mark.skipif(NO_HUGE_PAGES, reason="glibc's settings need Linux with transparent huge pages"),
        ),
        pytest.param(
            "tcmalloc",
            marks=pytest.mark.skipif(
                find_tcmalloc() is None, reason="tcmalloc is not installed (apt install libtcmalloc-minimal4)"
            ),
        ),
    ],
)
def test_the_peak_of_the_first_whole_step_is_the_peak_of_the_run(tmp_path, allocator: str) -> None:
    config = tmp_path / "allocator.yaml"
    config.write_text(f"host_allocator: {allocator}\n")
    for entry in _peaks(tmp_path, "--config-file", str(config)):
        peaks = entry["peaks"]
        assert entry["tcmalloc"] == (allocator == "tcmalloc")  # the worker really runs on the allocator asked for
        growth = (peaks[-1] - peaks[1]) / peaks[1]
        assert growth <= (0.05 if allocator == "tcmalloc" else 0.02), (
            f"rank {entry['rank']}: peak rose {growth:.1%} after step 2: {[p >> 20 for p in peaks]} MB"
        )
