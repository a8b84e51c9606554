"""meshkit against DeepSpeed (`pip install 'meshkit[bench]'`; DeepSpeed's CPU accelerator over gloo): ZeRO-1/2/3
at world 4 and a 2-stage 1F1B pipeline (× 2 data-parallel) against DeepSpeed's `PipelineModule` engine.

Same model (a stack of pre-norm MLP blocks, 17 M parameters), same initial weights, same data, same AdamW,
the same 25 MB reduction buckets (DeepSpeed's `reduce_bucket_size` / `allgather_bucket_size`,
`overlap_comm: true`; its defaults of 5e8 elements would allocate 2 GB of buffers per rank). ZeRO-3 twice:
DeepSpeed as it comes (its `stage3_max_reuse_distance` of 1e9 parameters keeps what forward gathered until
backward on a model this size: half the all-gathers, a higher peak), and `zero3-refetch` with it 0, gathering
again in backward as meshkit's ZeRO-3 (FSDP) does: the same work.
Every (system, layout) run is its own launch of 4 processes; runs are interleaved over `--rounds` rounds, the
order rotating each round, so machine noise hits all alike. Per run: the median step time (each step timed
at its slowest rank), the peak resident memory a rank added over its start (the largest rank), the bytes of
live tensors a rank holds after a step (parameters, gradients, optimizer state, buffers — counted the same way
for both: every tensor the garbage collector can reach, storages once), and the first losses. Prints medians
over rounds, the per-round ratio meshkit/DeepSpeed (median), and writes JSON.

    python bench/peers_deepspeed.py [--rounds 5] [--steps 12] [--out bench/results/peers-deepspeed-w4.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD, DIM, BLOCKS, MICRO, PIPE_MICRO, WARMUP = 4, 512, 8, 16, 4, 3
BUCKET_ELEMENTS = 25_000_000 // 4  # DeepSpeed's defaults are 5e8 elements (2 GB of fp32 buffers per rank)
LAYOUTS = ("zero1", "zero2", "zero3", "zero3-refetch", "pp2")
SYSTEMS = ("meshkit", "deepspeed")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block() for _ in range(BLOCKS)]


def batches(steps: int, dp_rank: int, per_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + dp_rank)
    return [(torch.randn(per_rank, DIM, generator=generator), torch.randn(per_rank, DIM, generator=generator))
            for _ in range(steps)]  # fmt: skip


def live_tensor_bytes() -> int:
    gc.collect()
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        try:
            if type(obj) is torch.Tensor or isinstance(obj, nn.Parameter):
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        except (RuntimeError, ReferenceError, NotImplementedError):
            continue
    return total


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def meshkit_run(layout: str, steps: int) -> tuple[Any, Any]:
    """One optimizer step per call, and what ends the run."""
    from meshkit import Engine

    settings: dict[str, Any] = {"seed": 0, "hang_doctor": False}
    if layout == "pp2":
        settings.update(pp=2, pipeline={"schedule": "1f1b", "microbatches": PIPE_MICRO})
    else:
        settings["zero_stage"] = int(layout[4])
    engine = Engine(**settings)
    model = nn.Sequential(*blocks())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = engine.prepare(model, optimizer, loss_fn=F.mse_loss)
    per_rank = MICRO * (PIPE_MICRO if layout == "pp2" else 1)
    data = batches(steps, engine.dp_rank, per_rank)

    def step(index: int) -> float:
        return float(engine.train_step(data[index]))

    return step, engine.end


def deepspeed_run(layout: str, steps: int) -> tuple[Any, Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    pipeline = layout == "pp2"
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": PIPE_MICRO if pipeline else 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if not pipeline:  # buckets of 25 MB (fp32), as meshkit's zero.bucket_mb and DDP's default
        buckets = {"reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS}
        if layout.startswith("zero3"):
            buckets = {"reduce_bucket_size": BUCKET_ELEMENTS, "stage3_prefetch_bucket_size": BUCKET_ELEMENTS}
        if layout == "zero3-refetch":  # gathers again in backward, as meshkit's (FSDP's) ZeRO-3 does: the same
            buckets["stage3_max_reuse_distance"] = 0  # work (by default it keeps what backward reuses soon)
        config["zero_optimization"] = {"stage": int(layout[4]), "overlap_comm": True, **buckets}
    layers = blocks()
    if pipeline:
        model: nn.Module = PipelineModule(layers=layers, loss_fn=F.mse_loss, num_stages=2, partition_method="uniform")
    else:
        model = nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dp_rank = engine.grid.get_data_parallel_rank() if pipeline else dist.get_rank()
    per_rank = MICRO * (PIPE_MICRO if pipeline else 1)
    data = batches(steps, dp_rank, per_rank)

    def step(index: int) -> float:
        inputs, targets = data[index]
        if pipeline:
            micro = iter(zip(inputs.split(MICRO), targets.split(MICRO), strict=True))
            return float(engine.train_batch(data_iter=micro))
        loss = F.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step, lambda: None


def worker(system: str, layout: str, steps: int, out: Path) -> None:
    start_rss = rss_bytes()
    step, end = (meshkit_run if system == "meshkit" else deepspeed_run)(layout, steps)
    losses, times = [], []
    for index in range(steps):
        dist.barrier()
        begin = time.perf_counter()
        losses.append(step(index))
        elapsed = torch.tensor([time.perf_counter() - begin])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    held = live_tensor_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_rss
    numbers = torch.tensor([float(peak), float(held)])
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses[:3])  # the mean over the ranks holding a loss (a pipeline's last stage)
    held_losses = [rank_losses for rank_losses in gathered if any(rank_losses)]
    last = [statistics.fmean(column) for column in zip(*held_losses, strict=True)]
    if dist.get_rank() == 0:
        result = {
            "median_step_s": statistics.median(times[WARMUP:]),
            "peak_rss_mb": float(numbers[0]) / 1e6,
            "held_mb": float(numbers[1]) / 1e6,
            "first_losses": [float(x) for x in last],
        }
        out.write_text(json.dumps(result))
    end()  # (meshkit: leaves the process group to its owner, this script)
    dist.barrier()
    dist.destroy_process_group()


def launch(system: str, layout: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", __file__,
                   "--worker", system, layout, "--steps", str(steps), "--out", str(out)]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if not out.exists():
            tail = (done.stderr or done.stdout)[-2000:]
            raise SystemExit(f"{system} {layout} failed (exit {done.returncode}):\n{tail}")
        if done.returncode != 0:  # the measurements are written: a fault while the processes exit is reported
            print(f"note: {system} {layout} exited {done.returncode} after writing its result:\n"
                  f"{(done.stderr or done.stdout)[-600:]}", flush=True)  # fmt: skip
        return {**json.loads(out.read_text()), "exit_code": done.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peers-deepspeed-w4.json")
    parser.add_argument("--worker", nargs=2, metavar=("SYSTEM", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        worker(args.worker[0], args.worker[1], args.steps, args.out)
        return 0
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise SystemExit("DeepSpeed is not installed: pip install 'meshkit[bench]'") from None
    layouts = args.layouts.split(",")
    runs = [(system, layout) for layout in layouts for system in SYSTEMS]
    results: dict[str, list[dict[str, Any]]] = {f"{s} {lay}": [] for s, lay in runs}
    for round_index in range(args.rounds):
        shift = round_index % len(runs)
        for system, layout in runs[shift:] + runs[:shift]:  # the order rotates every round
            found = launch(system, layout, args.steps)
            results[f"{system} {layout}"].append(found)
            print(f"round {round_index + 1} {system:9} {layout:6} {found['median_step_s'] * 1e3:8.1f} ms "
                  f"peak {found['peak_rss_mb']:7.1f} MB held {found['held_mb']:7.1f} MB", flush=True)  # fmt: skip
    rows = []
    print(f"\n{'layout':8}{'meshkit ms':>12}{'DeepSpeed ms':>14}{'step ratio':>12}{'peak MB m/DS':>16}"
          f"{'held MB m/DS':>16}{'losses equal':>14}")  # fmt: skip
    for layout in layouts:
        ours, theirs = results[f"meshkit {layout}"], results[f"deepspeed {layout}"]
        ratio = statistics.median(a["median_step_s"] / b["median_step_s"] for a, b in zip(ours, theirs, strict=True))
        row = {
            "layout": layout,
            "meshkit_step_s": statistics.median(r["median_step_s"] for r in ours),
            "deepspeed_step_s": statistics.median(r["median_step_s"] for r in theirs),
            "step_ratio": ratio,
            "meshkit_peak_mb": statistics.median(r["peak_rss_mb"] for r in ours),
            "deepspeed_peak_mb": statistics.median(r["peak_rss_mb"] for r in theirs),
            "meshkit_held_mb": statistics.median(r["held_mb"] for r in ours),
            "deepspeed_held_mb": statistics.median(r["held_mb"] for r in theirs),
            "meshkit_first_losses": ours[0]["first_losses"],
            "deepspeed_first_losses": theirs[0]["first_losses"],
        }
        row["losses_equal"] = all(
            abs(a - b) <= 1e-4 * max(abs(b), 1e-9)
            for a, b in zip(row["meshkit_first_losses"], row["deepspeed_first_losses"], strict=True)
        )
        rows.append(row)
        peak = f"{row['meshkit_peak_mb']:>8.0f}/{row['deepspeed_peak_mb']:<7.0f}"
        held = f"{row['meshkit_held_mb']:>8.0f}/{row['deepspeed_held_mb']:<7.0f}"
        steps = f"{row['meshkit_step_s'] * 1e3:>12.1f}{row['deepspeed_step_s'] * 1e3:>14.1f}{ratio:>12.3f}"
        print(f"{layout:8}{steps}{peak}{held}{str(row['losses_equal']):>14}")
    report = {
        "date": datetime.date.today().isoformat(), "world": WORLD, "rounds": args.rounds, "steps": args.steps,
        "model": {"dim": DIM, "blocks": BLOCKS, "params": sum(p.numel() for b in blocks() for p in b.parameters())},
        "micro_batch": MICRO, "pipeline_microbatches": PIPE_MICRO, "torch": torch.__version__,
        "deepspeed": __import__("deepspeed").__version__, "rows": rows, "runs": results,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
