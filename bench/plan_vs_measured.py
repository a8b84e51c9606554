"""The planner's predicted step time against measured, on this machine, at world 4: the reference GPT, the
planner's top 5 layouts (one per parallel shape first, as `layout: auto` picks them), each run for a few
measured steps on 4 CPU ranks. Reports Spearman's rank correlation of predicted vs measured step time and each
layout's relative error. The planner costs with this machine's profile, measured in the same run.

    python bench/plan_vs_measured.py [--steps 6] [--out bench/results/plan-vs-measured-w4.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 4
CONFIG = {
    "model": {"dim": 256, "n_layers": 4, "n_heads": 8, "max_seq_len": 128},
    "train": {"micro_batch_size": 4, "seq_len": 128, "steps": 1000},
    "probe": {"top_k": 5},
    "hang_doctor": False,
}


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for position, index in enumerate(order):
            out[index] = float(position)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def rank_main(rank: int, port: int, steps: int, out: Any) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
        }
    )  # fmt: skip
    torch.set_num_threads(1)
    from meshkit.config.resolve import resolve
    from meshkit.engine import Engine
    from meshkit.planning.layout_probe import measure, propose
    from meshkit.recipes.train import probe_step

    dist.init_process_group("gloo")
    config = {**CONFIG, "probe": {"top_k": 5, "steps": steps}, "logging": {"dir": "/tmp/meshkit-bench-plan"}}
    resolved = resolve(code=config, env={})
    candidates = propose(resolved, WORLD, WORLD, torch.device("cpu"))
    for candidate in candidates:
        measure(resolved, candidate, probe_step, Engine)
    if rank == 0:
        out.put([c.row() for c in candidates])
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan-vs-measured-w4.json")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=rank_main, args=(r, port, args.steps, queue)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    rows = None
    while rows is None:
        try:
            rows = queue.get(timeout=2)
        except Exception:  # queue.Empty: still measuring, unless a rank died
            dead = [(r, proc.exitcode) for r, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                raise SystemExit(f"rank(s) died: {dead}") from None
    for proc in procs:
        proc.join(timeout=60)
    ran = [row for row in rows if row["error"] is None]
    predicted, measured = [row["predicted_step_s"] for row in ran], [row["step_s"] for row in ran]
    rho = spearman(predicted, measured) if len(ran) > 1 else float("nan")
    for row in rows:
        row["relative_error"] = row["predicted_step_s"] / row["step_s"] - 1 if row["step_s"] else None
    print(f"{'layout':44}{'predicted':>11}{'measured':>11}{'error':>8}")
    for row in rows:
        measured_text = f"{row['step_s'] * 1e3:.1f} ms" if row["step_s"] else row["error"]
        error = f"{row['relative_error']:+.0%}" if row["relative_error"] is not None else "-"
        print(f"{row['description']:44}{row['predicted_step_s'] * 1e3:>8.1f} ms{measured_text:>11}{error:>8}")
    worst = max((abs(row["relative_error"]) for row in rows if row["relative_error"] is not None), default=None)
    print(f"Spearman (predicted vs measured step time): {rho:.2f}; largest error {worst:.0%}")
    report = {
        "date": datetime.date.today().isoformat(), "world": WORLD, "config": CONFIG, "rows": rows,
        "spearman": rho, "largest_relative_error": worst,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
