"""Checkpoint speed: sync save, async blocking time, throughput against `dd`, and load, for a >100 MB model.

The reference GPT (about 51M parameters, 203 MB of fp32 weights; with AdamW's two states the checkpoint is
about 610 MB) is trained one step under ZeRO-3 on 2 ranks, then saved and loaded REPEATS (5) times each way.

- sync save: `save_state(dir)` until the checkpoint is committed (files written, fsynced, hashed into the
  manifest, renamed into place);
- async blocking: how long `save_state(dir, asynchronous=True)` holds the training loop (the copy to host
  memory); async total is the time until `wait_for_checkpoint()` returns. The first async save also
  allocates the host buffers (reused afterwards) and is reported on its own;
- dd: `dd if=/dev/zero bs=4M conv=fsync` of the same number of bytes, as the disk's plain sequential write
  speed;
- load: `load_state(dir)` into the same layout.

Times are medians over the repeats. Ratios (async blocking / sync, dd time / sync time) are taken within each
repeat, against the baseline measured next to it, and their median is reported: the disk's speed drifts.

    python bench/checkpoint.py [--out bench/results/checkpoint.json] [--dir /tmp/meshkit-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshkit import Engine
from meshkit.config import LaunchSettings
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.models.gpt import GPT, GPTConfig, lm_loss

MODEL = GPTConfig(vocab_size=256, dim=1024, n_layers=4, n_heads=16, max_seq_len=64)
WORLD, REPEATS = 2, 5


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _dd_seconds(directory: Path, size: int) -> float:
    target = directory / "dd.bin"
    blocks = max(1, size // (4 << 20))
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={blocks}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - start
    target.unlink()
    return seconds * size / (blocks * (4 << 20))


def worker(out: Path, root: Path) -> None:
    engine = Engine(seed=0, zero_stage=3)
    model = GPT(MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = engine.prepare(model, optimizer, loss_fn=lm_loss)
    tokens = torch.randint(0, 256, (1, 33))
    engine.train_step((tokens[:, :-1], tokens[:, 1:]))  # AdamW states exist from here on
    rows: dict[str, list[float]] = {"sync": [], "async_blocking": [], "async_total": [], "load": [], "dd": []}
    size = 0
    for repeat in range(REPEATS):
        sync_dir, async_dir = root / f"sync-{repeat}", root / f"async-{repeat}"
        rows["sync"].append(_timed(lambda d=sync_dir: engine.save_state(d)))
        if engine.is_main_process:
            size = sum(p.stat().st_size for p in sync_dir.iterdir())
        dist.barrier()
        start = time.perf_counter()
        engine.save_state(async_dir, asynchronous=True)
        blocking = time.perf_counter() - start
        engine.wait_for_checkpoint()
        dist.barrier()
        rows["async_total"].append(time.perf_counter() - start)
        everyone: list[float] = [0.0] * WORLD
        dist.all_gather_object(everyone, blocking)
        rows["async_blocking"].append(max(everyone))
        rows["load"].append(_timed(lambda d=sync_dir: engine.load_state(d)))
        rows["dd"].append(_dd_seconds(root, size) if engine.is_main_process else 0.0)
        dist.barrier()  # checkpoints are removed at the end: deleting GBs between measures adds noise
    if engine.is_main_process:
        medians = {name: statistics.median(values) for name, values in rows.items()}
        # Ratios per repeat (each against the baseline measured next to it), then their median.
        ratios = {
            "async_blocking_over_sync": statistics.median(
                b / s for b, s in zip(rows["async_blocking"], rows["sync"], strict=True)
            ),
            "dd_over_sync": statistics.median(d / s for d, s in zip(rows["dd"], rows["sync"], strict=True)),
        }
        out.write_text(json.dumps({"bytes": size, "median_s": medians, "ratios": ratios, "runs_s": rows}))
    engine.end()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/checkpoint.json"))
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    root = Path(tempfile.mkdtemp(prefix="meshkit-bench-", dir=args.dir))
    part = args.out.with_suffix(".tmp")
    try:
        code = launch(
            LaunchTarget(os.path.abspath(__file__), ("--worker", str(part), str(root))),
            LaunchPlan(LaunchSettings(nproc_per_node=WORLD)),
        )
        if code:
            return code
        result = json.loads(part.read_text())
    finally:
        part.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    m, size, ratios = result["median_s"], result["bytes"], result["ratios"]
    summary = {
        "benchmark": "checkpoint",
        "layout": f"zero_stage 3, {WORLD} ranks",
        "parameters": sum(p.numel() for p in GPT(MODEL).parameters()),
        "checkpoint_bytes": size,
        "sync_save_s": m["sync"],
        "async_blocking_s": m["async_blocking"],
        "async_blocking_fraction_of_sync": ratios["async_blocking_over_sync"],
        "async_total_s": m["async_total"],
        "first_async_blocking_s": result["runs_s"]["async_blocking"][0],
        "save_mb_per_s": size / m["sync"] / 1e6,
        "dd_mb_per_s": size / m["dd"] / 1e6,
        "save_throughput_vs_dd": ratios["dd_over_sync"],
        "load_s": m["load"],
        "runs_s": result["runs_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ncheckpoint of {size / 1e6:.0f} MB ({summary['layout']}), medians of {REPEATS} (ratios: per repeat)")
    print(f"{'measure':<28}{'value':>12}")
    for label, value in (
        ("sync save (s)", f"{m['sync']:.2f}"),
        ("async blocking (s)", f"{m['async_blocking']:.3f}"),
        ("async blocking / sync", f"{summary['async_blocking_fraction_of_sync']:.1%}"),
        ("first async blocking (s)", f"{summary['first_async_blocking_s']:.3f}"),
        ("async total (s)", f"{m['async_total']:.2f}"),
        ("save MB/s", f"{summary['save_mb_per_s']:.0f}"),
        ("dd MB/s (same bytes)", f"{summary['dd_mb_per_s']:.0f}"),
        ("save / dd throughput", f"{summary['save_throughput_vs_dd']:.2f}"),
        ("load (s)", f"{m['load']:.2f}"),
    ):
        print(f"{label:<28}{value:>12}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
