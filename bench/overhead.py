"""Step time against peers: meshkit `engine.train_step` with DDP against a hand-written torch DDP loop, HF
Accelerate and Lightning Fabric (when installed: `pip install 'meshkit[bench]'`), then meshkit ZeRO-3 against
torch's `fully_shard` — with model-FLOPs utilisation (MFU) against each process's measured fp32 matmul peak.

All loops run in the same processes on the same model, data and process world, interleaved step by step (the
order rotates every step), so machine noise hits all alike; each step is timed at its slowest rank. Prints a
table and writes JSON.

    python bench/overhead.py [--nproc 2] [--steps 60] [--out bench/results/overhead-w2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshkit import Engine
from meshkit.config import LaunchSettings
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.models.gpt import GPT, GPTConfig, lm_loss

MODEL = GPTConfig(dim=128, n_layers=4, n_heads=4, max_seq_len=128)
MICRO_BATCH, SEQ_LEN, WARMUP = 8, 128, 5
Batch = tuple[torch.Tensor, torch.Tensor]
# Each loop against the plain torch loop of its kind.
BASELINE = {
    "meshkit": "torch",
    "torch": "torch",
    "accelerate": "torch",
    "fabric": "torch",
    "meshkit zero3": "torch fully_shard",
    "torch fully_shard": "torch fully_shard",
}
Step = Callable[[Batch], None]


def batches(steps: int, rank: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, MODEL.vocab_size, (steps, MICRO_BATCH, SEQ_LEN + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def fresh_model() -> GPT:
    torch.manual_seed(0)
    return GPT(MODEL)


def engine_step(engine: Engine) -> Step:
    def step(batch: Batch) -> None:
        engine.train_step(batch)

    return step


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, backward: Callable | None = None) -> Step:
    def step(batch: Batch) -> None:
        inputs, targets = batch
        loss = lm_loss(model(inputs), targets)
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step


def ddp_runners(engine: Engine) -> dict[str, Step]:
    meshkit_model = fresh_model()
    meshkit_opt = torch.optim.AdamW(meshkit_model.parameters(), lr=1e-3)
    engine.prepare(meshkit_model, meshkit_opt, loss_fn=lm_loss)
    raw = DistributedDataParallel(fresh_model())  # default bucket size, same as meshkit's default
    runners: dict[str, Step] = {
        "meshkit": engine_step(engine),
        "torch": plain_step(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3)),
    }
    try:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        acc_model = fresh_model()
        acc_model, acc_opt = accelerator.prepare(acc_model, torch.optim.AdamW(acc_model.parameters(), lr=1e-3))
        runners["accelerate"] = plain_step(acc_model, acc_opt, accelerator.backward)
    except ImportError:
        pass
    try:
        from lightning_fabric import Fabric

        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=dist.get_world_size())
        fabric.launch()
        fab_model = fresh_model()
        fab_model, fab_opt = fabric.setup(fab_model, torch.optim.AdamW(fab_model.parameters(), lr=1e-3))
        runners["fabric"] = plain_step(fab_model, fab_opt, fabric.backward)
    except ImportError:
        pass
    return runners


def zero3_runners() -> dict[str, Step]:
    from torch.distributed.fsdp import fully_shard

    engine = Engine(seed=0, zero_stage=3)
    meshkit_model = fresh_model()
    meshkit_opt = torch.optim.AdamW(meshkit_model.parameters(), lr=1e-3)
    engine.prepare(meshkit_model, meshkit_opt, loss_fn=lm_loss)
    raw = fresh_model()
    for block in raw.layers:
        fully_shard(block)
    fully_shard(raw)
    return {
        "meshkit zero3": engine_step(engine),
        "torch fully_shard": plain_step(raw, torch.optim.AdamW(raw.parameters(), lr=1e-3)),
    }


def interleaved(runners: dict[str, Step], steps: int, rank: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for index, batch in enumerate(batches(steps + WARMUP, rank)):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            runners[name](batch)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            if index >= WARMUP:
                times[name].append(elapsed.item())
    return times


def matmul_peak_flops(size: int = 1024, repeats: int = 10) -> float:
    """This process's fp32 matmul throughput, measured while every rank measures (they share the cores)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    seconds = time.perf_counter() - start
    return 2 * size**3 * repeats / seconds


def model_flops_per_step() -> float:
    """Per rank: 6Ψ per token (forward and backward) plus attention's 12·L·h·s per token."""
    params = sum(p.numel() for p in fresh_model().parameters())
    tokens = MICRO_BATCH * SEQ_LEN
    return 6 * params * tokens + 12 * MODEL.n_layers * MODEL.dim * SEQ_LEN * tokens


def worker(steps: int, out: Path) -> None:
    engine = Engine(seed=0)
    peak = matmul_peak_flops()
    times = interleaved(ddp_runners(engine), steps, engine.process_index)
    times.update(interleaved(zero3_runners(), steps, engine.process_index))
    peaks = [0.0] * engine.num_processes
    dist.all_gather_object(peaks, peak)
    if engine.is_main_process:
        report(times, engine.num_processes, out, statistics.median(peaks))
    engine.end()


def report(times: dict[str, list[float]], world: int, out: Path, peak_flops: float) -> None:
    median = {name: statistics.median(values) for name, values in times.items()}
    mean = {name: statistics.fmean(values) for name, values in times.items()}
    flops = model_flops_per_step()
    mfu = {name: flops / (seconds * peak_flops) for name, seconds in median.items()}
    result = {
        "benchmark": "step time against peers (fp32, CPU/gloo)",
        "world_size": world,
        "steps": len(times["torch"]),
        "model": MODEL.model_dump(),
        "micro_batch": MICRO_BATCH,
        "seq_len": SEQ_LEN,
        "median_step_s": median,
        "mean_step_s": mean,
        "ratio_median": median["meshkit"] / median["torch"],
        "ratio_mean": mean["meshkit"] / mean["torch"],
        "ratio_median_vs_torch": {name: median[name] / median[BASELINE[name]] for name in median},
        "target_ratio": 1.02,
        "matmul_peak_gflops_per_rank": peak_flops / 1e9,
        "model_gflops_per_step_per_rank": flops / 1e9,
        "mfu": mfu,
        "torch": torch.__version__,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nstep time, world {world}, {result['steps']} interleaved steps each; "
        f"fp32 matmul peak {peak_flops / 1e9:.1f} GFLOP/s per rank"
    )
    print(f"{'loop':<20}{'median (ms)':>12}{'mean (ms)':>11}{'vs torch':>10}{'MFU':>8}")
    for name in median:
        ratio = result["ratio_median_vs_torch"][name]
        print(f"{name:<20}{median[name] * 1e3:>12.1f}{mean[name] * 1e3:>11.1f}{ratio:>10.3f}{mfu[name]:>8.1%}")
    print(f"written to {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/overhead-w<nproc>.json")
    args = parser.parse_args()
    args.out = args.out or Path(f"bench/results/overhead-w{args.nproc}.json")
    if "RANK" in os.environ:
        worker(args.steps, args.out)
        return 0
    argv = ("--steps", str(args.steps), "--out", str(args.out.resolve()))
    plan = LaunchPlan(LaunchSettings(nproc_per_node=args.nproc))
    return launch(LaunchTarget(os.path.abspath(__file__), argv), plan)


if __name__ == "__main__":
    sys.exit(main())
