"""BENCHMARKS.md is rendered from the bench JSON: every section, its command and its table."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.report import SECTIONS, render

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_every_recorded_bench_gets_a_section_with_its_command_and_table(tmp_path) -> None:
    text = render(RESULTS)
    for title, name, command, _ in SECTIONS:
        assert f"## {title}" in text
        if (RESULTS / name).is_file():
            assert f"`{command}`" in text and f"bench/results/{name}" in text
    assert text.count("|---|") >= sum((RESULTS / name).is_file() for _, name, _, _ in SECTIONS)
    shutil.copy(RESULTS / "checkpoint.json", tmp_path / "checkpoint.json")
    partial = render(tmp_path)
    assert "Not run yet: `python bench/memory.py --nproc 4`." in partial and "async blocking" in partial
