"""ZeRO's collectives on the host: meshkit's rings of sends (`runtime/ring_collectives.py`) against gloo's own.

For each world size, one launch of that many processes times, on a ZeRO-3 unit's worth of fp32 data (16.8 MB,
the peers model's unit of 2 blocks; each rank holds 1/world of it): the all-gather (gloo's
`all_gather_into_tensor` against `ring_all_gather`, both into a flat output that holds this rank's part already)
and the reduce-scatter (gloo's `reduce_scatter_tensor` against `ring_reduce_scatter`, both on a fresh copy of the
same input). Calls alternate between the two so that machine noise hits both alike; each figure is the median over
the calls, each call timed at its slowest rank. Both results are checked equal first. Prints a table, writes JSON.

    python bench/host_collectives.py [--worlds 2,4,8] [--calls 20] [--mb 16.8]
        [--out bench/results/host-collectives.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshkit.runtime.ring_collectives import ring_all_gather, ring_reduce_scatter


def timed(call: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    call()
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def worker(calls: int, megabytes: float, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    part = int(megabytes * 1e6 / 4) // world
    output = torch.empty(part * world)
    mine = output[rank * part : (rank + 1) * part]
    full = torch.randn(part * world, generator=torch.Generator().manual_seed(rank))
    scratch, shard = torch.empty_like(full), torch.empty(part)
    mine.normal_()
    gloo_gathered, ring_gathered = torch.empty_like(output), output.clone()
    dist.all_gather_into_tensor(gloo_gathered, mine.clone())
    ring_all_gather(ring_gathered, ring_gathered[rank * part : (rank + 1) * part], group)
    reference = torch.empty(part)
    dist.reduce_scatter_tensor(reference, full.clone())
    ring_reduce_scatter(shard, full.clone(), group)
    equal = bool(torch.equal(gloo_gathered, ring_gathered)) and bool(torch.allclose(shard, reference, atol=1e-5))
    times: dict[str, list[float]] = {"gather gloo": [], "gather ring": [], "scatter gloo": [], "scatter ring": []}
    for _ in range(calls):
        times["gather gloo"].append(timed(lambda: dist.all_gather_into_tensor(output, mine)))
        times["gather ring"].append(timed(lambda: ring_all_gather(output, mine, group)))
        scratch.copy_(full)
        times["scatter gloo"].append(timed(lambda: dist.reduce_scatter_tensor(shard, scratch)))
        scratch.copy_(full)
        times["scatter ring"].append(timed(lambda: ring_reduce_scatter(shard, scratch, group)))
    if rank == 0:
        medians = {name: statistics.median(values[2:]) for name, values in times.items()}
        out.write_text(json.dumps({"world": world, "part_mb": part * 4 / 1e6, "equal": equal, **medians}))
    dist.destroy_process_group()


def launch(world: int, calls: int, megabytes: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", __file__,
                   "--worker", "--calls", str(calls), "--mb", str(megabytes), "--out", str(out)]  # fmt: skip
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        if not out.exists():
            raise SystemExit(f"world {world} failed (exit {done.returncode}):\n{(done.stderr or done.stdout)[-2000:]}")
        return json.loads(out.read_text())


def section(data: dict[str, Any]) -> str:
    """The BENCHMARKS.md section (bench/report.py)."""
    from bench.report_table import table

    rows = [
        [str(row["world"]), f"{row['part_mb']:.2f}", f"{row['gather gloo'] * 1e3:.1f}",
         f"{row['gather ring'] * 1e3:.1f}", f"{row['gather_ratio']:.2f}", f"{row['scatter gloo'] * 1e3:.1f}",
         f"{row['scatter ring'] * 1e3:.1f}", f"{row['scatter_ratio']:.2f}", "yes" if row["equal"] else "NO"]
        for row in data["rows"]
    ]  # fmt: skip
    return (
        f"A ZeRO-3 unit of {data['unit_mb']:g} MB of fp32, each rank holding 1/world of it; median of "
        f"{data['calls']} alternating calls, each timed at its slowest rank; gloo's own collective against "
        "meshkit's ring of sends (`runtime/ring_collectives.py`, what ZeRO-1/2/3 use on the host).\n\n"
        + table(
            [
                "world",
                "part MB",
                "all-gather gloo ms",
                "ring ms",
                "ratio",
                "reduce-scatter gloo ms",
                "ring ms",
                "ratio",
                "same result",
            ],
            rows,
        )  # fmt: skip
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--mb", type=float, default=16.8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host-collectives.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.calls, args.mb, args.out)
        return 0
    rows = []
    print(f"{'world':>5}{'part MB':>9}{'gather gloo':>13}{'ring':>9}{'ratio':>7}{'scatter gloo':>14}{'ring':>9}"
          f"{'ratio':>7}{'equal':>7}")  # fmt: skip
    for world in (int(w) for w in args.worlds.split(",")):
        row = launch(world, args.calls, args.mb)
        row["gather_ratio"] = row["gather ring"] / row["gather gloo"]
        row["scatter_ratio"] = row["scatter ring"] / row["scatter gloo"]
        rows.append(row)
        print(f"{world:>5}{row['part_mb']:>9.2f}{row['gather gloo'] * 1e3:>10.1f} ms{row['gather ring'] * 1e3:>6.1f} ms"
              f"{row['gather_ratio']:>7.2f}{row['scatter gloo'] * 1e3:>11.1f} ms{row['scatter ring'] * 1e3:>6.1f} ms"
              f"{row['scatter_ratio']:>7.2f}{str(row['equal']):>7}", flush=True)  # fmt: skip
    report = {"date": datetime.date.today().isoformat(), "unit_mb": args.mb, "calls": args.calls,
              "torch": torch.__version__, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
