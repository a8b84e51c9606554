"""Write BENCHMARKS.md: every bench table, rendered from the JSON results in bench/results/.

Each section names the command that produced it and the date of its JSON file; the machine is described once
(results are produced on the machine that runs `make bench`, which ends by running this script).

    python bench/report.py [--results bench/results] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as `python bench/report.py`: its sections sit beside it in `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import section as gpu_check_section
from bench.host_collectives import section as host_collectives_section
from bench.loss_memory import section as loss_memory_section
from bench.report_compare import (
    against_commit,
    moe,
    peak_memory,
    peers_deepspeed,
    plan_vs_measured,
    preference,
    ring_window,
)
from bench.report_table import table as _table
from bench.zoo_table import bench_section as zoo_section


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    memory = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        kib = int(meminfo.read_text().split()[1])
        memory = f", {kib / 2**20:.0f} GiB memory"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores{memory}; Python {platform.python_version()}, torch {torch.__version__}, gloo"


def _date(path: Path, data: dict[str, Any]) -> str:
    """When the result was measured: its own `date`, else the commit that last changed the file (a fresh clone
    gives every file today's mtime), else the file's mtime for a result not committed yet."""
    if isinstance(data.get("date"), str):
        return data["date"]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args, "--", path.name], capture_output=True, text=True, cwd=path.parent)

    changed = git("status", "--porcelain")
    if changed.returncode == 0 and not changed.stdout.strip():
        committed = git("log", "-1", "--format=%cs")
        if committed.returncode == 0 and committed.stdout.strip():
            return committed.stdout.strip()
    return datetime.date.fromtimestamp(path.stat().st_mtime).isoformat()


def overhead(data: dict[str, Any]) -> str:
    median, ratios, mfu = data["median_step_s"], data.get("ratio_median_vs_torch", {}), data.get("mfu", {})
    rows = [
        [name, f"{median[name] * 1e3:.1f} ms", f"{ratios.get(name, float('nan')):.3f}", f"{mfu.get(name, 0):.1%}"]
        for name in median
    ]
    peak = data.get("matmul_peak_gflops_per_rank")
    note = f"fp32 matmul peak {peak:.1f} GFLOP/s per rank. " if peak else ""
    return (
        f"World {data['world_size']}, {data['steps']} interleaved steps per loop, GPT dim {data['model']['dim']}, "
        f"{data['model']['n_layers']} layers, seq {data['seq_len']}, micro-batch {data['micro_batch']}. {note}"
        "Ratios: each loop's median step over its plain-torch counterpart (DDP loops over torch DDP, ZeRO-3 over "
        "`fully_shard`); target for meshkit ≤ 1.02.\n\n" + _table(["loop", "median step", "vs torch", "MFU"], rows)
    )


def memory(data: dict[str, Any]) -> str:
    rows = [
        [row["layout"], f"{row['held_mb']:.1f}", f"{row['formula_mb']:.1f}", f"{row['held_over_formula']:.3f}",
         f"{row['rss_added_mb']:.0f}", f"{row['peak_rss_added_mb']:.0f}",
         f"{row['runtime_mb']:.0f}" if "runtime_mb" in row else "-",
         f"{row['estimate_mb']:.0f}" if "estimate_mb" in row else "-",
         f"{row['peak_rss_added_over_estimate']:.2f}" if "estimate_mb" in row else "-", f"{row['step_vs_ddp']:.2f}"]
        for row in data["rows"]
    ]  # fmt: skip
    header = ["layout", "held MB", "formula MB", "held/formula", "rss+ MB", "peak rss+ MB", "runtime MB"]
    header += ["estimate MB", "peak/estimate", "step vs DDP"]
    note = (
        "runtime = what two steps of a tiny GPT in the same layout added first (kernel code, the layout's runtime "
        "objects; counted in the estimate)"
    )
    return f"World {data['world_size']}, Ψ = {data['psi'] / 1e6:.1f} M, fp32 AdamW; {note}; MB = 10⁶ bytes.\n\n" + (
        _table(header, rows)
    )


def pipeline(data: dict[str, Any]) -> str:
    rows = [
        [row["schedule"], str(row["p"]), str(row["m"]), f"{row['bubble']:.3f}",
         "-" if row.get("theory") is None else f"{row['theory']:.3f}"]
        for row in data["rows"]
    ]  # fmt: skip
    return "Idle fraction of a step per schedule (synthetic 20/40 ms blocks).\n\n" + _table(
        ["schedule", "p", "m", "bubble", "theory"], rows
    )


def checkpoint(data: dict[str, Any]) -> str:
    rows = [
        ["sync save", f"{data['sync_save_s']:.2f} s ({data['save_mb_per_s']:.0f} MB/s)"],
        ["async blocking", f"{data['async_blocking_s']:.3f} s ({data['async_blocking_fraction_of_sync']:.1%} of sync)"],
        ["first async blocking", f"{data.get('first_async_blocking_s', float('nan')):.3f} s"],
        ["async until committed", f"{data['async_total_s']:.2f} s"],
        ["dd of the same bytes", f"{data['dd_mb_per_s']:.0f} MB/s (save/dd {data['save_throughput_vs_dd']:.2f})"],
        ["load", f"{data['load_s']:.2f} s"],
    ]
    size = data["checkpoint_bytes"] / 1e6
    return f"{size:.0f} MB checkpoint ({data['layout']}).\n\n" + _table(["measure", "value"], rows)


def comm(data: dict[str, Any]) -> str:
    rows = [
        [row["op"], f"{row['bytes'] / 2**20:g} MiB", f"{row['time_us']:.0f}", f"{row['algbw_gbps']:.3f}",
         f"{row['busbw_gbps']:.3f}", f"{row['vs_bare']:.2f}" if "vs_bare" in row else "-"]
        for row in data["rows"]
    ]  # fmt: skip
    return f"{data['ranks']} ranks, {data['backend']}.\n\n" + _table(
        ["op", "size", "time (µs)", "algbw GB/s", "busbw GB/s", "vs bare all_reduce"], rows
    )


def activation(data: dict[str, Any]) -> str:
    rows = [
        [row["mode"], f"{row['saved_mb']:.1f}", f"{row['saved_fraction']:.0%}", f"{row['peak_saved_mb']:.1f}",
         f"{row['peak_saved_fraction']:.0%}", f"{row['per_block_mb']:.2f}", f"{row['korthikanti_per_block_mb']:.2f}",
         f"{row['peak_rss_over_steady_mb']:.0f}", f"{row['step_vs_none']:.3f}"]
        for row in data["rows"]
    ]  # fmt: skip
    model, overlap = data["model"], data["overlap"]
    return (
        f"Reference GPT dim {model['dim']}, {model['n_layers']} blocks, {model['n_heads']} heads, seq "
        f"{data['seq_len']}, micro-batch {data['micro_batch']}, fp32, one process; MB = 10⁶ bytes. Targets: "
        "selective saves ≥ 40 % at ≤ 15 % extra step time, full saves ≥ 80 %.\n\n"
        + _table(
            [
                "mode",
                "kept MB",
                "saved",
                "with recompute MB",
                "saved",
                "per block MB",
                "Korthikanti MB",
                "peak RSS+ MB",
                "step vs none",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nWorld 2, {overlap['params'] / 1e6:.1f} M params, step-time ratios: DDP default buckets / one bucket "
        f"after backward = {overlap['default_over_one_bucket']:.3f} (one bucket {overlap['one_bucket_step_s']:.2f} s)"
        + (
            f"; FSDP prefetch of 2 blocks / torch's default = {overlap['fsdp_prefetch_over_default']:.3f}."
            if "fsdp_prefetch_over_default" in overlap
            else "."
        )
    )


def finetune(data: dict[str, Any]) -> str:
    median, rate = data["median_step_s"], data["tokens_per_s"]
    rows = [[name, f"{median[name] * 1e3:.1f} ms", f"{rate[name]:,.0f}"] for name in median]
    versus = data.get("ratio_meshkit_vs_accelerate")
    ratios = f"meshkit / Accelerate tokens/s = {versus:.3f}; " if versus else ""
    return (
        f"World {data['world_size']}, {data['steps']} interleaved steps per loop, LoRA r {data['lora_r']} on every "
        f"Linear of a Llama-style model, micro-batch {data['micro_batch']} samples (packed: rows of "
        f"{data['sequence_len']} tokens), real (non-padding) tokens per second. {ratios}packed / padded = "
        f"{data['ratio_packed_vs_padded']:.3f}.\n\n" + _table(["loop", "median step", "tokens/s"], rows)
    )


def parameter_server(data: dict[str, Any]) -> str:
    parts = [
        f"World {data['world']}: DDP trains on 4 ranks, the parameter-server runs on 1 server + 3 workers; same MLP, "
        f"same data, {data['seconds']:g} s each; ratios against DDP in the same run. Time to target: when the first "
        "trainer's held-out loss first drops below the level every run reached (90 % of the way down). Staleness in "
        "steps of all workers, as the servers applied them."
    ]
    for table in data["scenarios"].values():
        rows = [
            [
                row["run"],
                str(row["trainers"]),
                f"{row['samples_per_s']:,.0f}",
                f"{row['throughput_vs_ddp']:.3f}",
                "-" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.2f} s",
                "-" if row["time_vs_ddp"] is None else f"{row['time_vs_ddp']:.3f}",
                "-" if row["staleness_max"] is None else f"max {row['staleness_max']}, mean {row['staleness_mean']}",
            ]
            for row in table["rows"]
        ]
        header = ["run", "trainers", "samples/s", "vs DDP", "to target", "vs DDP", "staleness"]
        parts += [f"**{table['title'].capitalize()}** (target loss {table['target_loss']}):", _table(header, rows)]
    return "\n\n".join(parts)


def plan_published(data: dict[str, Any]) -> str:
    rows = [
        [
            row["run"],
            f"{row['gpus']} {row['device'].upper()}",
            row["published_layout"],
            f"{row['published_mfu']:.1%}",
            f"{row['predicted_mfu']:.1%}",
            f"{row['relative_error']:+.0%}",
            row["planner_layout"] or "does not fit",
        ]
        for row in data["rows"]
    ]
    header = ["run", "GPUs", "published layout", "published MFU", "predicted MFU", "error", "planner's costing"]
    return (
        "MFU = model FLOPs (no recomputation) / (step time × GPUs × bf16 peak). Sources: Narayanan et al. 2021 "
        "(arXiv 2104.04473) Table 1, whose TFLOP/s count the recomputed forward, converted here; Llama Team 2024 "
        f"(arXiv 2407.21783) Table 4. Largest error {data['largest_relative_error']:.0%}.\n\n" + _table(header, rows)
    )


def estimate_vs_gpu(data: dict[str, Any]) -> str:
    rows = [
        [
            row["model"],
            f"{row['micro_batch']} × {row['seq_len']}",
            row["recompute"],
            f"{row['measured_gb']:.2f}",
            f"{row['estimate_gb']:.2f}",
            f"{row['ratio']:.3f}",
            f"{row['eager_estimate_gb']:.2f}",
            row["source"],
        ]
        for row in data["rows"]
    ]
    header = ["model", "micro-batch × seq", "recompute", "measured GB", "estimate GB", "ratio", "eager GB", "source"]
    return (
        "Measured: `torch.cuda.max_memory_allocated` on one NVIDIA H200 (torch 2.11 + CUDA 13), bf16 autocast, fused "
        "AdamW, SDPA, torch.compile, plain loss. Estimate: `meshkit estimate ... --compile --optimizer-step fused` "
        'from the shape alone; "eager GB": the same without `--compile` (what an uncompiled step keeps).\n\n'
        + _table(header, rows)
    )


SECTIONS: list[tuple[str, str, str, Callable[[dict[str, Any]], str]]] = [
    ("Step time against peers, world 2", "overhead-w2.json", "python bench/overhead.py --nproc 2", overhead),
    ("Step time against peers, world 4", "overhead-w4.json", "python bench/overhead.py --nproc 4", overhead),
    (
        "Model-state memory per ZeRO stage, and the estimator's accuracy",
        "memory.json",
        "python bench/memory.py --nproc 4",
        memory,
    ),
    ("Memory and the estimator at world 8", "memory-w8.json", "python bench/memory.py --nproc 8", memory),
    ("Activation checkpointing, offload and DDP overlap", "activation.json", "python bench/activation.py", activation),
    ("Pipeline bubbles", "pipeline.json", "python bench/pipeline.py", pipeline),
    ("Checkpoint save and load", "checkpoint.json", "python bench/checkpoint.py", checkpoint),
    ("Collectives", "comm-w2.json", "meshkit bench comm --nproc-per-node 2", comm),
    ("LoRA fine-tune throughput", "finetune-w2.json", "python bench/finetune.py --nproc 2", finetune),
    ("Preference training by reference model, world 2", "preference-w2.json", "python bench/preference.py", preference),
    ("Parameter server against DDP with slow ranks", "ps-w4.json", "python bench/ps.py", parameter_server),
    (
        "ZeRO and pipelines against DeepSpeed, world 4",
        "peers-deepspeed-w4.json",
        "python bench/peers_deepspeed.py",
        peers_deepspeed,
    ),
    (
        "ZeRO's collectives on the host: rings against gloo's own",
        "host-collectives.json",
        "python bench/host_collectives.py",
        host_collectives_section,
    ),
    (
        "Planner step-time model against published runs",
        "plan-published.json",
        "python bench/plan_published.py",
        plan_published,
    ),
    (
        "Planner step-time model against measured steps, world 4",
        "plan-vs-measured-w4.json",
        "python bench/plan_vs_measured.py",
        plan_vs_measured,
    ),
    ("Peak memory per step, world 4", "peak-memory-w4.json", "python bench/peak_memory.py", peak_memory),
    ("Every causal LM of transformers in every layout, world 2", "zoo.json", "python bench/zoo.py", zoo_section),
    ("Expert parallelism on a mixture of experts, world 4", "moe-w4.json", "python bench/moe.py", moe),
    ("Ring attention with a sliding window, cp 4", "ring-window-w4.json", "python bench/ring_window.py", ring_window),
    (
        "Fused loss and tiled MLP: memory of one step",
        "loss-memory.json",
        "python bench/loss_memory.py",
        loss_memory_section,
    ),
    ("GPU check on an NVIDIA H200", "gpu-check-h200.json", "make gpu-check", gpu_check_section),
    ("The memory estimate on a GPU", "estimate-vs-gpu.json", "python bench/estimate_vs_gpu.py", estimate_vs_gpu),
    (
        "Step time against the previous commit",
        "against-commit.json",
        "python bench/against_commit.py --commit HEAD~1",
        against_commit,
    ),
]


def render(results: Path) -> str:
    parts = [
        "# Benchmarks",
        "",
        "Every bench table, rendered by `python bench/report.py` from the JSON in `bench/results/` (`make bench` "
        f"runs them all, then this). Machine: {_machine()}.",
    ]
    for title, name, command, section in SECTIONS:
        path = results / name
        if not path.is_file():
            parts += ["", f"## {title}", "", f"Not run yet: `{command}`."]
            continue
        data = json.loads(path.read_text())
        parts += [
            "",
            f"## {title}",
            "",
            f"`{command}` — {_date(path, data)}, `bench/results/{name}`.",
            "",
            section(data),
        ]
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("bench/results"))
    parser.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    args = parser.parse_args()
    args.out.write_text(render(args.results))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
