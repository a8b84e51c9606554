"""Parameter server against DDP with a straggler: throughput and time to a target loss at world 4.

DDP (4 ranks), sync parameter server and async parameter server (1 server + 3 workers, staleness bound 2 and
unbounded) train the same MLP on the same synthetic regression task for the same wall-clock budget; the last
data-parallel rank sleeps a fixed time every step (a slow or shared machine). Throughput is samples trained per
second over all trainers; the time to target is when the first trainer's held-out loss (measured on the weights
it holds, every few steps) first drops below the target. Prints a table and writes JSON.

    python bench/ps.py [--seconds 8] [--straggler-ms 40] [--out bench/results/ps-w4.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkit import Engine
from meshkit.paramserver.placement import serve_report

WORLD, BATCH, HIDDEN, FEATURES, EVAL_EVERY = 4, 32, 256, 64, 5
RUNS: dict[str, dict[str, Any]] = {
    "DDP": {},
    "PS sync": {"strategy": "parameter_server"},
    "PS async (bound 2)": {"strategy": "parameter_server", "ps": {"mode": "async", "max_staleness": 2}},
    "PS async (unbounded)": {"strategy": "parameter_server", "ps": {"mode": "async"}},
}


def task(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher network's outputs on random inputs (the same teacher for training and held-out data)."""
    teacher = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(FEATURES, 32, generator=teacher), torch.randn(32, 4, generator=teacher)
    x = torch.randn(samples, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x @ w1 / FEATURES**0.5) @ w2


def student() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 4)
    )


def rank_main(
    rank: int, port: int, settings: dict[str, Any], seconds: float, straggler_s: float, jitter: bool, out: Any
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD),
        }
    )
    engine = Engine(hang_doctor=False, threads_per_process=1, **settings)
    model = student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # at lr 0.05 async diverges
    model, optimizer = engine.prepare(model, optimizer, loss_fn=lambda out, y: nn.functional.mse_loss(out, y))
    x, y = task(BATCH * 400, seed=1 + engine.dp_rank)
    held_x, held_y = task(1024, seed=99)
    served = settings.get("strategy") == "parameter_server"
    slow = engine.dp_rank == engine.dp_size - 1
    pause = random.Random(engine.dp_rank)
    curve: list[tuple[float, float]] = []
    steps = 0
    engine.wait_for_everyone()
    start = time.perf_counter()
    while engine.is_worker:
        i = (steps * BATCH) % len(x)
        if jitter:  # every trainer: a random pause of straggler_s on average
            time.sleep(pause.uniform(0, 2 * straggler_s))
        elif slow:
            time.sleep(straggler_s)
        engine.train_step((x[i : i + BATCH], y[i : i + BATCH]))
        steps += 1
        if engine.dp_rank == 0 and steps % EVAL_EVERY == 0:
            with torch.no_grad():
                curve.append((time.perf_counter() - start, float(nn.functional.mse_loss(model(held_x), held_y))))
        over = torch.tensor([float(time.perf_counter() - start >= seconds)])
        if not served:  # DDP ranks must stop at the same step
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if over.item():
            break
    elapsed = time.perf_counter() - start
    report = serve_report(engine.placement)  # a server's report: the staleness it applied
    staleness = dict(report.staleness) if report is not None else {}
    out.put((rank, engine.is_worker, steps, elapsed, curve, staleness))
    engine.end()


def run(settings: dict[str, Any], seconds: float, straggler_s: float, jitter: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        ctx.Process(target=rank_main, args=(r, port, settings, seconds, straggler_s, jitter, out)) for r in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    trainers = [r for r in results if r[1]]
    samples = sum(r[2] for r in trainers) * BATCH
    elapsed = max(r[3] for r in trainers)
    curve = next(r[4] for r in trainers if r[4])
    staleness = {k: v for r in results if not r[1] for k, v in r[5].items()}
    applied = sum(staleness.values())
    return {
        "trainers": len(trainers),
        "samples_per_s": samples / elapsed,
        "curve": curve,
        "staleness_max": max(staleness, default=None),
        "staleness_mean": sum(k * v for k, v in staleness.items()) / applied if applied else None,
    }


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


def scenario(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The rows of one scenario: ratios against DDP measured in the same run, the time to a common target."""
    first = results["DDP"]["curve"][0][1]
    final = max(min(loss for _, loss in r["curve"]) for r in results.values())
    target = first - 0.9 * (first - final)  # 90 % of the way down that every run reached
    base = results["DDP"]
    base_reach = time_to(base["curve"], target)
    rows = []
    for name, r in results.items():
        reach = time_to(r["curve"], target)
        rows.append(
            {
                "run": name,
                "trainers": r["trainers"],
                "samples_per_s": round(r["samples_per_s"], 1),
                "throughput_vs_ddp": round(r["samples_per_s"] / base["samples_per_s"], 3),
                "time_to_target_s": None if reach is None else round(reach, 2),
                "time_vs_ddp": None if reach is None or not base_reach else round(reach / base_reach, 3),
                "best_loss": round(min(loss for _, loss in r["curve"]), 4),
                "staleness_max": r["staleness_max"],
                "staleness_mean": None if r["staleness_mean"] is None else round(r["staleness_mean"], 2),
            }
        )
    return {"target_loss": round(target, 4), "rows": rows}


def show(title: str, table: dict[str, Any]) -> None:
    print(f"{title}; target loss {table['target_loss']:.4f} (90 % of the way down that every run reached)")
    print(f"{'run':24} {'trainers':>8} {'samples/s':>10} {'vs DDP':>7} {'to target s':>12} {'vs DDP':>7} staleness")
    for row in table["rows"]:
        reach = "-" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.2f}"
        ratio = "-" if row["time_vs_ddp"] is None else f"{row['time_vs_ddp']:.3f}"
        numbers = f"{row['samples_per_s']:>10.1f} {row['throughput_vs_ddp']:>7.3f} {reach:>12} {ratio:>7}"
        stale = "-" if row["staleness_max"] is None else f"max {row['staleness_max']}, mean {row['staleness_mean']}"
        print(f"{row['run']:24} {row['trainers']:>8} {numbers} {stale}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--straggler-ms", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/ps-w4.json"))
    args = parser.parse_args()
    pause = args.straggler_ms / 1000
    scenarios = {}
    for name, jitter, title in (
        ("straggler", False, f"one trainer sleeps {args.straggler_ms:.0f} ms every step"),
        ("jitter", True, f"every trainer sleeps 0-{2 * args.straggler_ms:.0f} ms at random every step"),
    ):
        results = {run_name: run(settings, args.seconds, pause, jitter) for run_name, settings in RUNS.items()}
        scenarios[name] = {"title": title, **scenario(results)}
        show(f"world {WORLD}, {args.seconds:.0f} s each, {title}", scenarios[name])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "date": datetime.date.today().isoformat(),
        "world": WORLD,
        "straggler_ms": args.straggler_ms,
        "seconds": args.seconds,
        "scenarios": scenarios,
    }
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
