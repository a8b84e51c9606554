"""Ring attention with a sliding window against full causal attention, context parallel over 4 ranks.

One cp world calls `ring_attention` forward and backward on one long sequence (its 2·cp chunks spread over the
ranks) with full causal attention (the baseline), then with sliding windows of several widths. Per case: the
median time of a forward + backward (slowest rank) and its ratio to full attention, and the bytes each rank sends
to the others per call (keys and values out, their gradients back), counted on the wire, against full attention's.
A window only as wide as a chunk needs the neighbouring ranks' blocks: 2 exchanges instead of cp − 1. Prints a
table and writes JSON.

    python bench/ring_window.py [--nproc 4] [--seq 8192] [--repeats 5] [--out bench/results/ring-window-w4.json]
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

if __package__ in (None, ""):  # run as `python bench/ring_window.py`: the report's section sits beside it in `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_compare import ring_window as ring_window_section
from meshkit.config import LaunchSettings
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.parallel.context.apply import shard_sequence
from meshkit.parallel.context.ring_attention import ring_attention

HEADS, HEAD_DIM = 8, 64


class SendMeter:
    """Counts the bytes this rank's point-to-point sends put on the wire."""

    def __init__(self) -> None:
        self.sent = 0
        self.original = dist.batch_isend_irecv

    def __call__(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return self.original(ops)


def worker(seq: int, repeats: int, windows: list[int | None], out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    meter = SendMeter()
    dist.batch_isend_irecv = meter  # (this bench's process only: count what ring attention sends)
    cp, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (shard_sequence(torch.randn(1, HEADS, seq, HEAD_DIM, generator=generator), cp, rank, dim=2)
                     for _ in range(4))  # fmt: skip
    rows = []
    for window in windows:
        seconds, sent = [], []
        for _ in range(repeats):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            before, start = meter.sent, time.perf_counter()
            ring_attention(*inputs, dist.group.WORLD, window=window).backward(grad)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
            seconds.append(float(elapsed))
            sent.append(meter.sent - before)
        rows.append({"window": window, "seconds": seconds, "sent_bytes": max(sent)})
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part", type=Path, default=None, help="(internal) where the world writes its figures")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    chunk = args.seq // (2 * args.nproc)
    windows: list[int | None] = [None, 4 * chunk, chunk, chunk // 4]
    if "RANK" in os.environ:
        worker(args.seq, args.repeats, windows, args.part)
        return 0
    out = args.out or Path(f"bench/results/ring-window-w{args.nproc}.json")
    part = out.with_suffix(".part")
    argv = ("--seq", str(args.seq), "--repeats", str(args.repeats), "--part", str(part.resolve()))
    code = launch(LaunchTarget(os.path.abspath(__file__), argv), LaunchPlan(LaunchSettings(nproc_per_node=args.nproc)))
    if code:
        return code
    measured: list[dict[str, Any]] = json.loads(part.read_text())
    part.unlink()
    base_time = statistics.median(measured[0]["seconds"][1:])
    base_sent = measured[0]["sent_bytes"]
    rows = []
    for row in measured:
        median = statistics.median(row["seconds"][1:])
        rows.append({
            "window": row["window"],
            "median_s": median,
            "time_ratio_vs_full": median / base_time,
            "sent_mb": row["sent_bytes"] / 2**20,
            "sent_ratio_vs_full": row["sent_bytes"] / base_sent,
        })  # fmt: skip
    shape = {"seq": args.seq, "chunk": chunk, "heads": HEADS, "head_dim": HEAD_DIM, "batch": 1}
    data = {"nproc": args.nproc, "repeats": args.repeats, "shape": shape, "rows": rows}
    print(ring_window_section(data))  # as BENCHMARKS.md shows it
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
