"""The zoo sweep's results (`bench/zoo.py`'s JSON) as counts and as docs/any-model.md's table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

COLUMNS = {"ddp2": "DDP", "zero3_2": "ZeRO-3", "tp2": "tp 2", "tp2_sp": "tp 2 + SP", "cp2": "cp 2", "pp2": "pp 2",
           "ep2": "ep 2"}  # fmt: skip
MARKS = {"ok": "✓", "mismatch": "✗ mismatch", "not applied": "✗ not applied", "crash": "crash", "hang": "timeout"}
BEGIN, END = "<!-- zoo table: bench/zoo.py --render -->", "<!-- end of zoo table -->"


def counts(data: dict[str, Any]) -> dict[str, int]:
    types = data.get("types", {})
    built = {name: entry for name, entry in types.items() if entry.get("builds")}
    cells = [cell for entry in built.values() for cell in entry["cells"].values()]
    out = {"types": len(types), "built": len(built), "cells": len(cells)}
    for status in ("ok", "refused", "mismatch", "not applied", "crash", "hang"):
        out[status] = sum(cell["status"] == status for cell in cells)
    out["read_back"] = sum(cell["status"] == "ok" and "applied" in cell for cell in cells)
    out["every_layout"] = sum(
        bool(entry["cells"]) and all(cell["status"] == "ok" for cell in entry["cells"].values())
        for entry in built.values()
    )
    return out


def summary(data: dict[str, Any]) -> str:
    n = counts(data)
    share = n["ok"] / n["cells"] if n["cells"] else 0.0
    return (
        f"{n['built']} of {n['types']} causal-LM types build a tiny model; {n['every_layout']} train in every "
        f"layout; cells: {n['ok']} ✓ ({share:.0%}; {n['read_back']} of them with the layout read back from the run's "
        f"record), {n['refused']} refused, {n['mismatch']} mismatch, {n['not applied']} not applied, {n['crash']} "
        f"crash, {n['hang']} timeout (transformers {data.get('transformers', '?')})"
    )


def render(data: dict[str, Any]) -> str:
    """The table, its numbered refusal reasons and the types that build no tiny model."""
    reasons: dict[str, int] = {}
    lines = ["| model type | " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    unbuilt = []
    for name, entry in sorted(data.get("types", {}).items()):
        if not entry.get("builds"):
            unbuilt.append(f"`{name}` ({entry.get('reason', 'unknown')})")
            continue
        cells = []
        for layout in COLUMNS:
            cell = entry["cells"].get(layout)
            if cell is None:
                cells.append("—" if layout == "ep2" and not entry.get("moe") else "not run")
            elif cell["status"] == "refused":
                number = reasons.setdefault(scrubbed(cell.get("reason", "")), len(reasons) + 1)
                cells.append(f"refused [{number}]")
            else:
                cells.append(MARKS[cell["status"]] + (f" [{_note(cell, reasons)}]" if cell["status"] != "ok" else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out = [summary(data) + ".", "", *lines, ""]
    out += [f"{number}. {reason}" for reason, number in reasons.items()]
    if unbuilt:
        out += ["", "No tiny model: " + "; ".join(unbuilt) + "."]
    return "\n".join(out)


def _note(cell: dict[str, Any], reasons: dict[str, int]) -> int:
    if cell["status"] == "mismatch" and not cell.get("reason"):
        worst = f" ({cell['worst']})" if cell.get("worst") else ""
        text = f"off by {cell.get('loss_error', 0):.1e} in loss, {cell.get('weight_error', 0):.1e} in weights{worst}"
    else:
        text = scrubbed(cell.get("reason") or "no result")
    return reasons.setdefault(text, len(reasons) + 1)


def scrubbed(reason: str) -> str:
    """A reason without what differs from run to run: a peer's address and port, the path of torch's build."""
    reason = re.sub(r"\[/[^\]]*/gloo/[^\]]*\]\s*", "gloo: ", reason)
    return re.sub(r"\[[0-9a-fA-F.:]+\]:\d+", "[a peer]", reason)


def write_docs(data: dict[str, Any], page: Path) -> None:
    """Replace the table between the markers of `page` with the rendered one."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{page} has no zoo table markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{render(data)}\n{END}{tail}")


def bench_section(data: dict[str, Any]) -> str:
    """BENCHMARKS.md's section: the summary, each layout's count of ✓ / refused / mismatch / crash / hang."""
    rows = []
    built = [entry for entry in data.get("types", {}).values() if entry.get("builds")]
    for layout, title in COLUMNS.items():
        cells = [entry["cells"][layout] for entry in built if layout in entry["cells"]]
        counted = [sum(cell["status"] == status for cell in cells) for status in ("ok", "refused", "mismatch", "crash",
                                                                                   "hang")]  # fmt: skip
        rows.append([title, str(len(cells)), *map(str, counted)])
    header = ["layout", "types run", "✓", "refused", "mismatch", "crash", "timeout"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return summary(data) + ". Every cell: docs/any-model.md's zoo table.\n\n" + "\n".join(lines)
