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


def test_the_zoo_table_counts_cells_and_numbers_each_reason(tmp_path) -> None:
    from bench.zoo_table import BEGIN, END, counts, render, write_docs

    data = {
        "transformers": "5.0",
        "types": {
            "llama": {"builds": True, "moe": False, "cells": {"tp2": {"status": "ok", "applied": "tp: 50%"},
                                                              "cp2": {"status": "ok"}}},
            "bloom": {"builds": True, "moe": False,
                      "cells": {"tp2": {"status": "ok"}, "cp2": {"status": "refused", "reason": "no positions"}}},
            "mamba": {"builds": True, "moe": False,
                      "cells": {"tp2": {"status": "hang"}, "cp2": {"status": "refused", "reason": "no positions"}}},
            "dbrx": {"builds": False, "reason": "AttributeError: rope_theta", "cells": {}},
        },
    }  # fmt: skip
    assert counts(data) == {"types": 4, "built": 3, "cells": 6, "ok": 3, "refused": 2, "mismatch": 0, "crash": 0,
                            "hang": 1, "every_layout": 1, "not applied": 0, "read_back": 1}  # fmt: skip
    table = render(data)
    assert "| bloom | not run | not run | ✓ | not run | refused [1] | not run | — |" in table
    assert "| mamba | not run | not run | timeout [2] |" in table and "1. no positions" in table
    assert "No tiny model: `dbrx` (AttributeError: rope_theta)." in table
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    write_docs(data, page)
    text = page.read_text()
    assert "old" not in text and text.endswith(f"{END}\n\nafter\n") and "| llama |" in text
