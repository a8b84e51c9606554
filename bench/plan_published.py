"""The planner's step-time model against published large runs: predicted MFU of the published layout (the
fastest fitting candidate with the published tp/cp/pp/dp) next to the published MFU.

    python bench/plan_published.py [--out bench/results/plan-published.json]

The references and how their MFU is read are in `meshkit/planning/published_runs.py`; the test holding each row within
30 % is tests/planning/test_plan_performance.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from meshkit.planning.published_runs import PUBLISHED, compare


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan-published.json")
    args = parser.parse_args()
    rows = []
    for run in PUBLISHED:
        found = compare(run)
        layout, time = found.layout, found.layout.time if found.layout else None
        rows.append(
            {
                "run": run.name,
                "source": run.source,
                "device": run.device,
                "gpus": run.gpus,
                "published_layout": f"tp{run.degrees.tp} cp{run.degrees.cp} pp{run.degrees.pp} dp{run.degrees.dp}",
                "planner_layout": layout.describe() if layout else None,
                "published_mfu": run.published_mfu,
                "predicted_mfu": found.predicted_mfu,
                "relative_error": found.relative_error,
                "predicted_step_s": time.step_s if time else None,
                "fits": layout is not None,
            }
        )
    print(f"{'run':38}{'device':>8}{'published':>11}{'predicted':>11}{'error':>8}  layout")
    for row in rows:
        print(
            f"{row['run']:38}{row['device']:>8}{row['published_mfu']:>11.1%}{row['predicted_mfu']:>11.1%}"
            f"{row['relative_error']:>+8.0%}  {row['planner_layout']}"
        )
    worst = max(abs(row["relative_error"]) for row in rows)
    print(f"largest relative error: {worst:.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.date.today().isoformat(), "rows": rows, "largest_relative_error": worst}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
