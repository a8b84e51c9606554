"""Pipeline bubbles: each stage's busy and idle time per step, against (p−1)/(m+p−1), for every schedule.

The model is synthetic: each block's forward and backward wait a fixed time (a sleep), so every stage's work
per micro-batch is exactly known and the CPU's two cores (shared by up to four ranks) cannot distort it; what
is measured is the schedule and meshkit's pipeline path. Busy time is the sum of those waits on a rank plus the
CPU time the rank spends running the schedule (a few ms per micro-batch here); idle is the rest of the step,
time spent waiting for other stages. The bubble is idle / step time, averaged over the ranks. Prints a table
and writes JSON.

    python bench/pipeline.py [--out bench/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshkit import Engine
from meshkit.config import LaunchSettings
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.parallel.pipeline.stages import SCHEDULE_CLASSES, SINGLE_STAGE, schedule_class

DIM, BLOCKS, FORWARD_S, BACKWARD_S = 16, 8, 0.02, 0.04  # per block; a rank holds BLOCKS / p of them
MICROBATCHES, STEPS, CHUNKS = (2, 4, 8, 16), 3, 2


class Clock:
    """Busy time of this rank: the fixed waits of the blocks it runs."""

    def __init__(self) -> None:
        self.busy = 0.0

    def __deepcopy__(self, memo: dict) -> Clock:
        return self  # a rank's stages (copies of the model) share one clock

    def spend(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - start


class Work(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock):  # type: ignore[override]
        ctx.clock = clock
        clock.spend(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.clock.spend(BACKWARD_S)
        return grad, None


class WorkBlock(nn.Module):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.scale = nn.Parameter(torch.ones(DIM))
        self.ballast = nn.Parameter(torch.zeros(4096))  # makes blocks dominate the parameter-balanced split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Work.apply(x * self.scale, self.clock)


class Synthetic(nn.Module):
    pipeline_first, pipeline_last = ("embed",), ("head",)

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Linear(DIM, DIM, bias=False)
        self.layers = nn.ModuleList(WorkBlock(clock) for _ in range(BLOCKS))
        self.head: nn.Module | None = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def theory(schedule: str, p: int, m: int) -> float | None:
    """Idle fraction of the step: (p−1)/(m+p−1); v chunks per rank shrink it to (p−1)/(v·m+p−1)."""
    if schedule in SINGLE_STAGE:
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (CHUNKS * m + p - 1)
    return None


def measure(schedule: str, m: int) -> dict[str, Any]:
    clock = Clock()
    engine = Engine(pp=dist.get_world_size(), schedule=schedule, microbatches=m)
    model = engine.prepare(Synthetic(clock), loss_fn=F.mse_loss)
    engine.prepare(torch.optim.SGD(model.parameters(), lr=0.0))
    batch = (torch.randn(m, DIM), torch.randn(m, DIM))
    engine.train_step(batch)  # warm-up: shape inference, first send/recv
    bubbles = []
    for _ in range(STEPS):
        dist.barrier()
        clock.busy, start, cpu = 0.0, time.perf_counter(), time.thread_time()
        engine.train_step(batch)
        wall = time.perf_counter() - start
        # busy: the blocks' work plus the CPU this thread spent running the schedule itself (sleeping and
        # blocking on a peer use no CPU time); what is left is waiting for other stages
        busy = clock.busy + time.thread_time() - cpu
        bubbles.append(1 - busy / wall)
    engine.end()
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, statistics.fmean(bubbles))
    return {"schedule": schedule, "p": dist.get_world_size(), "m": m, "bubble": statistics.fmean(every_rank)}


def worker(out: Path) -> None:
    dist.init_process_group("gloo")
    rows = []
    for schedule in SCHEDULE_CLASSES:
        try:
            schedule_class(schedule)
        except ValueError:
            continue  # not in this torch
        # m < p is refused (1F1B-style schedules need a micro-batch per stage in flight)
        rows.extend(measure(schedule, m) for m in MICROBATCHES if m >= dist.get_world_size())
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/pipeline.json"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    rows = []
    for p in (2, 4):
        part = args.out.with_suffix(f".p{p}.tmp")
        code = launch(
            LaunchTarget(os.path.abspath(__file__), ("--worker", str(part))),
            LaunchPlan(LaunchSettings(nproc_per_node=p)),
        )
        if code:
            return code
        rows.extend(json.loads(part.read_text()))
        part.unlink()
    for row in rows:
        row["theory"] = theory(row["schedule"], row["p"], row["m"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"benchmark": "pipeline bubble", "chunks_per_rank": CHUNKS, "rows": rows}, indent=2) + "\n"
    )
    print(f"\n{'schedule':<26}{'p':>3}{'m':>4}{'measured':>10}{'theory':>9}{'diff':>8}{'ratio':>7}")
    for row in rows:
        expected = row["theory"]
        if expected is None:
            extra = f"{'-':>9}{'-':>8}{'-':>7}"
        else:
            extra = f"{expected:>9.3f}{row['bubble'] - expected:>+8.3f}{row['bubble'] / expected:>7.2f}"
        print(f"{row['schedule']:<26}{row['p']:>3}{row['m']:>4}{row['bubble']:>10.3f}{extra}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
