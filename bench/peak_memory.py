"""Peak resident memory per step: does a layout's peak stay where its first step put it, at what cost in speed?

World 4, 24 × Linear(2048, 2048) (100 M parameters), SGD with momentum, for DDP and ZeRO-0/1/2/3, each in a
world of its own, on each CPU allocator the launcher can give its workers (`runtime/host_memory.py`):
`tcmalloc` (preloaded, where installed), `glibc flat` (a fixed mmap threshold on huge pages) and `glibc`
(`host_memory_slack_mb: null`, glibc's own dynamic threshold: the baseline). The three of a layout run one after
another, so all see the machine in the same state. After every step each rank records its peak resident set size
(ru_maxrss) and the step's time; the table shows the largest rank's peak after step 1, the most it rose after
that, the step where it last rose, the median step time and its ratio to the baseline. Targets: the peak of
step 1 is the peak of the run (growth within 2 % of it) at a step time within 1.03× the baseline's.
Prints a table and writes JSON.

    python bench/peak_memory.py [--nproc 4] [--steps 20] [--layers 24] [--only zero3,zero3-glibc]
        [--out bench/results/peak-memory-w4.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshkit import Engine
from meshkit.config import LaunchSettings
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.runtime.host_memory import find_tcmalloc
from meshkit.runtime.memory import peak_rss_bytes

WIDTH, BATCH = 2048, 8
STAGES = {
    "ddp": {},
    "zero0": {"zero_stage": 0, "ddp": {"gradient_as_bucket_view": True}},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
}
ALLOCATORS = {  # row suffix: (host_allocator, host_memory_slack_mb)
    "tcmalloc": ("tcmalloc", 16.0),
    "glibc-flat": ("glibc", 16.0),
    "glibc": ("glibc", None),
}
LAYOUTS = {f"{stage} {suffix}": (stage, suffix) for stage in STAGES for suffix in ALLOCATORS}


def run_layout(name: str, steps: int, layers: int) -> tuple[list[int], list[float]]:
    """One layout's peak RSS after each step, and each step's seconds, on this rank."""
    torch.manual_seed(0)
    stage, suffix = LAYOUTS[name]
    settings = {**STAGES[stage], "host_memory_slack_mb": ALLOCATORS[suffix][1]}
    if suffix == "tcmalloc" and "tcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        raise RuntimeError(f"{name}: the worker does not run on tcmalloc (LD_PRELOAD={os.environ.get('LD_PRELOAD')})")
    if settings.get("zero_stage") == 3:
        settings["dp_shard"], settings["dp_replicate"] = -1, 1
    engine = Engine(**settings)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, optimizer = engine.prepare(model, optimizer)
    peaks, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(torch.randn(BATCH, WIDTH)).square().mean()
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
        peaks.append(peak_rss_bytes())
    engine.end()
    return peaks, seconds


def worker(name: str, steps: int, layers: int, out: Path) -> None:
    peaks = run_layout(name, steps, layers)
    gathered: list[list[int]] = [[] for _ in range(dist.get_world_size())] if dist.is_initialized() else [peaks]
    if dist.is_initialized():
        dist.all_gather_object(gathered, peaks)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(gathered))


def summarise(name: str, per_rank: list[tuple[list[int], list[float]]]) -> dict:
    largest = [max(rank[0][step] for rank in per_rank) for step in range(len(per_rank[0][0]))]
    slowest = [max(rank[1][step] for rank in per_rank) for step in range(len(per_rank[0][1]))]
    first, last = largest[0], largest[-1]
    rose_at = max((i + 1 for i in range(1, len(largest)) if largest[i] > largest[i - 1]), default=1)
    return {
        "layout": name,
        "peak_step1_mb": first / 2**20,
        "peak_end_mb": last / 2**20,
        "growth_mb": (last - first) / 2**20,
        "growth_ratio": last / first,
        "last_rise_at_step": rose_at,
        "median_step_s": statistics.median(slowest[1:] or slowest),
        "per_step_peak_mb": [p / 2**20 for p in largest],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--layout", default=None, help="(internal) the layout a worker runs")
    parser.add_argument("--part", type=Path, default=None, help="(internal) where a world writes its peaks")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default=None, help="comma-separated layouts to run (default: all)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.layout, args.steps, args.layers, args.part)
        return 0
    out = args.out or Path(f"bench/results/peak-memory-w{args.nproc}.json")
    rows = []
    names = [name.replace("-", " ", 1) for name in args.only.split(",")] if args.only else list(LAYOUTS)
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: choose among {', '.join(LAYOUTS)}")
    for name in names:
        part = out.with_suffix(f".{name.replace(' ', '-')}.part")
        argv = (
            "--layout",
            name,
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--part",
            str(part.resolve()),
        )
        allocator, slack = ALLOCATORS[LAYOUTS[name][1]]
        if allocator == "tcmalloc" and find_tcmalloc() is None:
            print(f"{name}: skipped, tcmalloc is not installed (apt install libtcmalloc-minimal4)")
            continue
        plan = LaunchPlan(LaunchSettings(nproc_per_node=args.nproc), allocator=allocator if slack else None)
        code = launch(LaunchTarget(os.path.abspath(__file__), argv), plan)
        if code:
            return code
        rows.append(summarise(name, json.loads(part.read_text())))
        part.unlink()
    baseline = {LAYOUTS[row["layout"]][0]: row["median_step_s"] for row in rows if row["layout"].endswith(" glibc")}
    for row in rows:
        base = baseline.get(LAYOUTS[row["layout"]][0])
        row["step_vs_glibc"] = row["median_step_s"] / base if base else None
    print(f"{'layout':<18}{'peak step 1 MB':>16}{'peak end MB':>13}{'growth MB':>11}{'ratio':>8}{'last rise':>11}"
          f"{'step s':>9}{'vs glibc':>10}")  # fmt: skip
    for row in rows:
        versus = f"{row['step_vs_glibc']:.3f}" if row["step_vs_glibc"] else "-"
        sizes = f"{row['peak_step1_mb']:>16.0f}{row['peak_end_mb']:>13.0f}{row['growth_mb']:>11.0f}"
        print(f"{row['layout']:<18}{sizes}{row['growth_ratio']:>8.3f}{row['last_rise_at_step']:>11}"
              f"{row['median_step_s']:>9.3f}{versus:>10}")  # fmt: skip
    result = {"nproc": args.nproc, "steps": args.steps, "layers": args.layers, "width": WIDTH, "rows": rows}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
