"""Engine overhead: meshkit `engine.train_step` with DDP against a hand-written torch DDP loop.

Both run in the same processes on the same model, data and process world, interleaved step by step (the
order alternates every step), so machine noise hits both alike. Prints a table and writes JSON.

    python bench/overhead.py [--nproc 2] [--steps 60] [--out bench/results/overhead-w2.json]
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
from torch.nn.parallel import DistributedDataParallel

from meshkit import Engine
from meshkit.config import LaunchSettings
from meshkit.launch import LaunchPlan, LaunchTarget, launch
from meshkit.models.gpt import GPT, GPTConfig, lm_loss

MODEL = GPTConfig(dim=128, n_layers=4, n_heads=4, max_seq_len=128)
MICRO_BATCH, SEQ_LEN, WARMUP = 8, 128, 5


def batches(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, MODEL.vocab_size, (steps, MICRO_BATCH, SEQ_LEN + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def worker(steps: int, out: Path) -> None:
    engine = Engine(seed=0)
    torch.manual_seed(0)
    meshkit_model = GPT(MODEL)
    meshkit_opt = torch.optim.AdamW(meshkit_model.parameters(), lr=1e-3)
    meshkit_model, meshkit_opt = engine.prepare(meshkit_model, meshkit_opt, loss_fn=lm_loss)

    torch.manual_seed(0)
    raw_model = DistributedDataParallel(GPT(MODEL))  # default bucket size, same as meshkit's default
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)

    def meshkit_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        engine.train_step(batch)

    def raw_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        loss = lm_loss(raw_model(inputs), targets)
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad()

    times: dict[str, list[float]] = {"meshkit": [], "torch": []}
    runners = {"meshkit": meshkit_step, "torch": raw_step}
    for index, batch in enumerate(batches(steps + WARMUP, engine.process_index)):
        order = ("meshkit", "torch") if index % 2 == 0 else ("torch", "meshkit")
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            runners[name](batch)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            if index >= WARMUP:
                times[name].append(elapsed.item())
    if engine.is_main_process:
        report(times, engine.num_processes, out)
    engine.end()


def report(times: dict[str, list[float]], world: int, out: Path) -> None:
    median = {name: statistics.median(values) for name, values in times.items()}
    mean = {name: statistics.fmean(values) for name, values in times.items()}
    result = {
        "benchmark": "engine overhead (DDP, fp32, CPU/gloo)",
        "world_size": world,
        "steps": len(times["torch"]),
        "model": MODEL.model_dump(),
        "micro_batch": MICRO_BATCH,
        "seq_len": SEQ_LEN,
        "median_step_s": median,
        "mean_step_s": mean,
        "ratio_median": median["meshkit"] / median["torch"],
        "ratio_mean": mean["meshkit"] / mean["torch"],
        "target_ratio": 1.02,
        "torch": torch.__version__,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nengine overhead, world {world}, {result['steps']} interleaved steps each")
    print(f"{'loop':<10}{'median step (ms)':>18}{'mean step (ms)':>16}")
    for name in ("torch", "meshkit"):
        print(f"{name:<10}{median[name] * 1e3:>18.1f}{mean[name] * 1e3:>16.1f}")
    print(f"{'ratio':<10}{result['ratio_median']:>18.3f}{result['ratio_mean']:>16.3f}   (target <= 1.02)")
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
