"""Memory per layout: bytes held per rank against the ZeRO formulas, resident memory against `meshkit estimate`.

Each layout (data parallel, ZeRO-1/2/3, NVMe offload, tensor, pipeline and context parallel) runs in its own
world of 4 or 8 ranks (so resident memory is the layout's own), one after the other in this run; DDP runs first and
last and the step-time ratios use the mean of the two. The model is built on the meta device and materialised
after sharding. Model states are measured right after the optimizer step, before zero_grad (parameters,
gradients and optimizer states all held; a pipeline's schedule frees its gradients within the step); "rss+" is
the resident memory the layout adds to the process after the engine started, of which "runtime" is what two
steps of a tiny GPT in the same layout added first (kernel code paged in, the layout's runtime objects: the same
for any model size). The estimate counts that runtime plus what the model needs. Prints a table and writes JSON.

    python bench/memory.py [--nproc 4|8] [--steps 8] [--out bench/results/memory.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshkit import Engine
from meshkit.config import LaunchSettings
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.models.gpt import GPT, GPTConfig, lm_loss
from meshkit.planning.estimate import ModelShape, estimate_memory
from meshkit.runtime.memory import current_rss_bytes

MODEL = GPTConfig(dim=320, n_layers=8, n_heads=8, max_seq_len=128)
TINY = GPTConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=128)  # measures the runtime's own working set
MICRO_BATCH, SEQ_LEN, WARMUP = 4, 128, 2


def layouts(offload_dir: str, world: int) -> list[tuple[str, dict, dict]]:
    """(name, engine settings, how `meshkit estimate` describes it) for each layout at this world size."""
    bucket_view = {"gradient_as_bucket_view": True}  # gradients are views of DDP's buckets: held once
    ddp = {"ddp": bucket_view}
    half = world // 2
    return [
        ("ddp", ddp, {"dp": world, **bucket_view}),
        ("zero1", {"zero_stage": 1}, {"dp": world, "zero_stage": 1}),
        ("zero2", {"zero_stage": 2}, {"dp": world, "zero_stage": 2}),
        # buckets small beside this model's 40 MB gradients
        ("zero2 4MB", {"zero_stage": 2, "zero": {"bucket_mb": 4}}, {"dp": world, "zero_stage": 2, "zero_bucket_mb": 4}),
        ("zero3", {"zero_stage": 3}, {"dp": world, "zero_stage": 3}),
        ("zero3+nvme", {"zero_stage": 3, "offload": "nvme", "offload_dir": offload_dir},
         {"dp": world, "zero_stage": 3, "offload": "nvme"}),
        (f"tp2 dp{half}", {"tp": 2}, {"dp": half, "tp": 2, "sequence_parallel": False, **bucket_view}),
        ("zero3 tp2", {"zero_stage": 3, "tp": 2}, {"dp": half, "tp": 2, "zero_stage": 3, "sequence_parallel": False}),
        # pp micro-batches (pipeline.microbatches = pp) of MICRO_BATCH / pp sequences each
        (f"pp2 dp{half}", {"pp": 2}, {"dp": half, "pp": 2, "micro_batch": MICRO_BATCH // 2, **bucket_view}),
        (f"cp2 dp{half}", {"cp": 2, **ddp}, {"dp": half, "cp": 2, **bucket_view}),  # DDP as in the ddp rows
        ("ddp again", ddp, {"dp": world, **bucket_view}),
    ]  # fmt: skip


def formula(name: str, psi: int, n: int, estimate_args: dict) -> float:
    """Model states by the ZeRO paper: fp32 params 4Ψ, grads 4Ψ, Adam moments 8Ψ over the layout's split
    (nvme: the moments are on disk, not in memory)."""
    if name in ("ddp", "ddp again", "zero1", "zero2", "zero2 4MB", "zero3", "zero3+nvme"):
        return {
            "ddp": 16 * psi,
            "ddp again": 16 * psi,
            "zero1": 8 * psi + 8 * psi / n,
            "zero2": 4 * psi + 12 * psi / n,
            "zero2 4MB": 4 * psi + 12 * psi / n,
            "zero3": 16 * psi / n,
            "zero3+nvme": 8 * psi / n,
        }[name]
    lines = estimate_memory(ModelShape.from_gpt(MODEL), precision="fp32", **estimate_args).as_json()
    return (lines["params_gb"] + lines["grads_gb"] + lines["optimizer_gb"]) * 1e9


def train(engine: Engine, config: GPTConfig, steps: int, after_step: Any = None) -> list[float]:
    """`steps` optimizer steps of a GPT of `config` in the engine's layout; each step's time at its slowest rank."""
    torch.manual_seed(0)
    with torch.device("meta"):  # materialised after sharding: full-size weights are never allocated
        model = GPT(config)
    model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn=lm_loss)
    generator = torch.Generator().manual_seed(engine.process_index)
    times = []
    for step in range(steps):
        tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ_LEN + 1), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        if engine.mesh.size("pp") > 1:  # the schedule runs forward and backward; gradients are freed in the step
            engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        else:
            inputs, targets = engine.shard_sequence((tokens[:, :-1], tokens[:, 1:]))  # cp: this rank's chunks
            with engine.loss_parallel():  # tp: vocab-sharded logits
                loss = lm_loss(model(inputs), targets)
            engine.backward(loss)
            optimizer.step()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        times.append(elapsed.item())
        if after_step is not None:
            after_step(step)
        optimizer.zero_grad()
    return times


def worker(overrides: dict, steps: int, out: Path) -> None:
    engine = Engine(seed=0, **overrides)
    baseline_rss = current_rss_bytes()  # torch and the process group; what the layout adds comes on top
    # The runtime's own working set (kernel code paged in, the layout's runtime objects) does not grow with the
    # model: a few steps of a tiny GPT in the same layout pay it before the measured model is built.
    own_dir = {"offload_dir": overrides["offload_dir"] + "-runtime"} if "offload_dir" in overrides else {}
    tiny = Engine(seed=0, **{**overrides, **own_dir})
    train(tiny, TINY, 2)
    tiny.end()
    gc.collect()
    runtime = current_rss_bytes() - baseline_rss
    report: dict[str, Any] = {}

    def measure(step: int) -> None:
        if step == WARMUP + steps - 1:
            report.update(engine.memory_report())
            report["rss_added"] = report["rss"] - baseline_rss
            report["peak_rss_added"] = report["peak_rss"] - baseline_rss
            report["runtime"] = runtime

    times = train(engine, MODEL, WARMUP + steps, measure)[WARMUP:]
    reports: list = [None] * engine.num_processes
    dist.all_gather_object(reports, report)
    if engine.is_main_process:
        params = sum(p.numel() for p in engine.unwrap_model().parameters())
        out.write_text(json.dumps({"reports": reports, "step_s": statistics.median(times), "psi": params}))
    engine.end()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, choices=[4, 8], help="world size")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, help="default: bench/results/memory.json (world 4), memory-w8.json")
    parser.add_argument("--worker", nargs=2, metavar=("LAYOUT_JSON", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker[0]), args.steps, Path(args.worker[1]))
        return 0
    # glibc keeps freed blocks below its (growing) mmap threshold in the heap, where they still count as
    # resident; a fixed low threshold returns freed tensors to the system at once, so RSS shows live memory.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, overrides, estimate_args in layouts(str(Path(scratch) / "nvme"), args.nproc):
            out = Path(scratch) / "result.json"
            argv = ("--steps", str(args.steps), "--worker", json.dumps(overrides), str(out))
            code = launch(
                LaunchTarget(os.path.abspath(__file__), argv), LaunchPlan(LaunchSettings(nproc_per_node=args.nproc))
            )
            if code:
                return code
            rows.append((name, {**json.loads(out.read_text()), "estimate_args": estimate_args}))
    default = Path("bench/results") / ("memory.json" if args.nproc == 4 else f"memory-w{args.nproc}.json")
    report(rows, args.nproc, args.out or default)
    return 0


def estimated_peak(estimate_args: dict, runtime: float) -> float:
    """`meshkit estimate` for the layout (bytes): model states, activations, buffers, the measured runtime."""
    args = {"seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "precision": "fp32", **estimate_args}
    return estimate_memory(ModelShape.from_gpt(MODEL), runtime_gb=runtime / 1e9, **args).total_gb * 1e9


def report(rows: list[tuple[str, dict]], world: int, out: Path) -> None:
    ddp_step = statistics.fmean(r["step_s"] for name, r in rows if name.startswith("ddp"))
    table = []
    for name, result in rows:
        worst = max(result["reports"], key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        held = worst["params"] + worst["grads"] + worst["optimizer"]
        expected = formula(name, result["psi"], world, result["estimate_args"])
        runtime = max(r["runtime"] for r in result["reports"])
        table.append(
            {
                "layout": name,
                "params_mb": worst["params"] / 1e6,
                "grads_mb": worst["grads"] / 1e6,
                "optimizer_mb": worst["optimizer"] / 1e6,
                "held_mb": held / 1e6,
                "formula_mb": expected / 1e6,
                "held_over_formula": held / expected,
                "rss_mb": max(r["rss"] for r in result["reports"]) / 1e6,
                "peak_rss_mb": max(r["peak_rss"] for r in result["reports"]) / 1e6,
                "rss_added_mb": max(r["rss_added"] for r in result["reports"]) / 1e6,
                "peak_rss_added_mb": max(r["peak_rss_added"] for r in result["reports"]) / 1e6,
                "step_vs_ddp": result["step_s"] / ddp_step,
                "runtime_mb": runtime / 1e6,
                "estimate_mb": estimated_peak(result["estimate_args"], runtime) / 1e6,
            }
        )
        table[-1]["peak_rss_added_over_estimate"] = table[-1]["peak_rss_added_mb"] / table[-1]["estimate_mb"]
    psi = rows[0][1]["psi"]
    result = {"benchmark": "sharded data parallel memory", "world_size": world, "psi": psi, "rows": table}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmodel states per rank, Ψ = {psi:,} parameters, N = {world} ranks, fp32 + AdamW")
    head = f"{'layout':<12}{'params':>9}{'grads':>9}{'optim':>9}{'held':>9}{'formula':>9}{'ratio':>7}"
    print(head + f"{'rss+':>9}{'peak rss+':>11}{'runtime':>9}{'estimate':>10}{'peak/est':>9}{'step/ddp':>10}   (MB)")
    for row in table:
        print(
            f"{row['layout']:<12}{row['params_mb']:>9.1f}{row['grads_mb']:>9.1f}{row['optimizer_mb']:>9.1f}"
            f"{row['held_mb']:>9.1f}{row['formula_mb']:>9.1f}{row['held_over_formula']:>7.3f}"
            f"{row['rss_added_mb']:>9.1f}{row['peak_rss_added_mb']:>11.1f}{row['runtime_mb']:>9.1f}{row['estimate_mb']:>10.1f}"
            f"{row['peak_rss_added_over_estimate']:>9.2f}{row['step_vs_ddp']:>10.2f}"
        )
    print(f"written to {out}")


if __name__ == "__main__":
    sys.exit(main())
