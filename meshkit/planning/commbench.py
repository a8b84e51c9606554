"""`meshkit bench comm`: time collectives per op and size; algorithm and bus bandwidth as nccl-tests defines them.

For a collective moving S bytes in t seconds on n ranks: algbw = S / t, and busbw = algbw × factor, the factor
making busbw comparable with the link speed whatever the op: all_reduce 2(n−1)/n, all_gather and
reduce_scatter (n−1)/n (S is the full, gathered size), broadcast 1. The same run also times a bare
`torch.distributed.all_reduce` loop at each size, the reference the harness is held to.

Run as `meshkit bench comm --nproc-per-node N`; each worker runs `python -m meshkit.planning.commbench --worker ...`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshkit.core.errors import MeshkitError
from meshkit.core.io import parse_size
from meshkit.runtime.mesh import stop_process_group

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


class CommBenchError(MeshkitError):
    """Settings the communication benchmark cannot run."""


def bus_factor(op: str, ranks: int) -> float:
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks
    if op == "broadcast":
        return 1.0
    raise CommBenchError(f"unknown op {op!r}: choose from {', '.join(OPS)}")


def parse_sizes(text: str) -> list[int]:
    """'1M,16M,64M' -> bytes; K, M, G are binary (as nccl-tests reads them); 'MB', 'MiB' etc. work too."""
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        unit = part[-1:].upper()
        try:
            if unit in "KMG" and part[:-1].replace(".", "", 1).isdigit():
                sizes.append(int(float(part[:-1]) * 1024 ** ("KMG".index(unit) + 1)))
            else:
                sizes.append(parse_size(part))
        except ValueError:
            raise CommBenchError(f"--sizes: {part!r} is not a size like 1M, 16M or 512K") from None
    if not sizes or min(sizes) <= 0:
        raise CommBenchError(f"--sizes {text}: give positive sizes like 1M,16M,64M")
    return sizes


def parse_ops(text: str) -> list[str]:
    ops = [op.strip() for op in text.split(",") if op.strip()]
    for op in ops:
        bus_factor(op, 2)
    return ops


def _operation(op: str, size: int, ranks: int, device: torch.device) -> Callable[[], None]:
    """One call of `op` moving `size` bytes in total (fp32 elements, rounded to a multiple of the ranks)."""
    from meshkit.runtime import collectives  # (here: the `meshkit` command imports this module for its options)

    elements = max(ranks, size // 4 // ranks * ranks)
    full = torch.ones(elements, device=device)
    piece = torch.empty(elements // ranks, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: collectives.all_gather_flat(full, piece, None)
    if op == "reduce_scatter":
        return lambda: collectives.reduce_scatter_flat(piece, full, None)
    return lambda: dist.broadcast(full, src=0)


def _time(call: Callable[[], None], iterations: int, device: torch.device) -> float:
    """Seconds per call, the slowest rank's, after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - start) / iterations], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def _bare_all_reduce(size: int, iterations: int, device: torch.device) -> float:
    tensor = torch.ones(max(1, size // 4), device=device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - start) / iterations], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def iterations_for(size: int) -> int:
    return max(5, min(200, (256 << 20) // max(size, 1)))


def measure(ops: list[str], sizes: list[int], repeats: int = 3, iterations: int | None = None) -> list[dict[str, Any]]:
    """Rows of op, size, time and bandwidths; the median of `repeats` timings, the bare loop interleaved."""
    ranks = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for size in sizes:
        calls = iterations or iterations_for(size)
        bare_runs: list[float] = []
        for op in ops:
            call = _operation(op, size, ranks, device)
            call()  # warm-up (connections, allocations)
            runs = []
            for _ in range(repeats):
                runs.append(_time(call, calls, device))
                if op == "all_reduce":
                    bare_runs.append(_bare_all_reduce(size, calls, device))
            seconds = statistics.median(runs)
            algbw = size / seconds / 1e9
            row: dict[str, Any] = {
                "op": op,
                "bytes": size,
                "ranks": ranks,
                "time_us": seconds * 1e6,
                "algbw_gbps": algbw,
            }
            row["busbw_gbps"] = algbw * bus_factor(op, ranks)
            if bare_runs:
                bare = statistics.median(bare_runs)
                row["bare_all_reduce_busbw_gbps"] = size / bare / 1e9 * bus_factor("all_reduce", ranks)
                row["vs_bare"] = row["busbw_gbps"] / row["bare_all_reduce_busbw_gbps"]
                bare_runs = []
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'op':<16}{'size':>10}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}{'vs bare':>9}")
    for row in rows:
        ratio = f"{row['vs_bare']:.2f}" if "vs_bare" in row else "-"
        size = f"{row['bytes'] / 2**20:g}M"
        print(
            f"{row['op']:<16}{size:>10}{row['time_us']:>12.1f}{row['algbw_gbps']:>12.3f}"
            f"{row['busbw_gbps']:>12.3f}{ratio:>9}"
        )


def worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=None)
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(__import__("os").environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        rows = measure(parse_ops(args.ops), sizes, iterations=args.iters or None)
        profile = None
        if args.profile is not None:  # matmul, memory and latency probes: every rank takes part
            from meshkit.planning.hardware import save_profile
            from meshkit.planning.probe import measure_profile

            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            profile = measure_profile(rows, device)
            if dist.get_rank() == 0:
                save_profile(profile, args.profile)
                print(
                    f"profile written to {args.profile}: matmul {profile.peak_tflops:.3g} TFLOP/s, memory "
                    f"{profile.memory_tbps * 1000:.3g} GB/s, link {profile.intra_gbps:.3g} GB/s, latency "
                    f"{profile.intra_latency_s * 1e6:.3g} us per step (meshkit plan --profile {args.profile})"
                )
        if dist.get_rank() == 0:
            print_table(rows)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            report = {"benchmark": "comm", "backend": backend, "ranks": dist.get_world_size(), "rows": rows}
            args.out.write_text(json.dumps(report, indent=2) + "\n")
            print(f"written to {args.out}")
    except BaseException:
        stop_process_group(wait_for_peers=False)
        raise
    stop_process_group(wait_for_peers=True)


if __name__ == "__main__":
    worker(sys.argv[1:])
