"""This tree's step-time overhead against another commit's: `bench/overhead.py` run from both trees in turns
(old, new, old, new, ...), each round measuring meshkit against the plain torch loop in the same processes. The
figure is the ratio of the two trees' `vs torch` medians — below 1.02 means a change cost no step time.

    python bench/against_commit.py --commit HEAD~1 [--rounds 2] [--nproc 2] [--steps 60]

Used for changes that must not change behaviour (a package move, a refactor). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOOPS = ("meshkit", "meshkit zero3")


def export_commit(commit: str, into: Path) -> str:
    """The commit's tree under `into` (git archive: tracked files only); returns the full hash."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True, check=True)
    archive = subprocess.run(["git", "archive", full.stdout.strip()], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return full.stdout.strip()


def overhead(tree: Path, nproc: int, steps: int, out: Path) -> dict[str, float]:
    """One run of the tree's own bench/overhead.py; each loop's median step over the plain torch loop's."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(tree / "bench" / "overhead.py"), "--nproc", str(nproc), "--steps", str(steps)]
    subprocess.run([*command, "--out", str(out)], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["ratio_median_vs_torch"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="HEAD~1", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "against-commit.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshkit-commit-") as tmp:
        old_tree = Path(tmp) / "old"
        old_tree.mkdir()
        commit = export_commit(args.commit, old_tree)
        ratios: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
        for round_index in range(args.rounds):
            for side, tree in (("old", old_tree), ("new", ROOT)):
                measured = overhead(tree, args.nproc, args.steps, Path(tmp) / f"{side}-{round_index}.json")
                for loop in LOOPS:
                    ratios[side].setdefault(loop, []).append(measured[loop])
    rows = []
    print(f"{'loop':<16}{'old vs torch':>14}{'new vs torch':>14}{'new / old':>11}")
    for loop in LOOPS:
        old, new = statistics.median(ratios["old"][loop]), statistics.median(ratios["new"][loop])
        rows.append({"loop": loop, "old_vs_torch": old, "new_vs_torch": new, "new_over_old": new / old})
        print(f"{loop:<16}{old:>14.3f}{new:>14.3f}{new / old:>11.3f}")
    result = {"commit": commit, "rounds": args.rounds, "nproc": args.nproc, "steps": args.steps, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"against {commit[:12]}; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
