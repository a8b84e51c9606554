"""Activation checkpointing and offload on the reference GPT, and DDP's communication/computation overlap.

1. Memory, one process per mode (world 1): the bytes `engine.activation_report()` counts (kept from forward
   to backward, and the peak with one block's recomputation), and the peak resident memory of a step above
   the resident memory between steps (peak reset through /proc/self/clear_refs; glibc's mmap threshold is
   fixed so freed tensors leave the resident set at once). Also the Korthikanti et al. per-layer formula.
2. Step time, one process, the modes interleaved round by round: each mode's step time over `none`'s
   (median of the per-round ratios).
3. Overlap, world 2, one process group, interleaved: DDP with default buckets (all-reduce starts while
   backward goes on) against one bucket as large as the model (nothing is sent before backward ends); FSDP
   with explicit prefetching of the next two blocks' all-gathers against torch's default.

    python bench/activation.py [--rounds 16] [--out bench/results/activation.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshkit import Engine
from meshkit.config import ActivationCheckpointConfig, DDPConfig, LaunchSettings, ShardingConfig
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.models.gpt import GPT, GPTConfig, lm_loss
from meshkit.parallel.activation import apply_activation_checkpointing
from meshkit.parallel.ddp import apply_ddp
from meshkit.parallel.fsdp import apply_fsdp
from meshkit.planning.estimate import layer_activation_bytes
from meshkit.runtime.memory import current_rss_bytes

MODEL = GPTConfig(dim=512, n_layers=4, n_heads=8, max_seq_len=256)
MICRO_BATCH, SEQ_LEN = 4, 256
MODES = {
    "none": ({"mode": "none"}, False),
    "selective": ({"mode": "selective"}, False),
    "full": ({"mode": "full"}, False),
    "every-2": ({"mode": "full", "every": 2}, False),
    "offload": ({"mode": "none"}, True),
}
OVERLAP_MODEL = GPTConfig(dim=384, n_layers=8, n_heads=6, max_seq_len=128)


def _batch(config: GPTConfig, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, config.vocab_size, (MICRO_BATCH, seq_len + 1), generator=torch.Generator().manual_seed(seed)
    )
    return tokens[:, :-1], tokens[:, 1:]


def _peak_rss_since_reset() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory_child(mode: str) -> dict:
    """One mode's report and resident-memory peak (run in its own process)."""
    checkpointing, offload = MODES[mode]
    with tempfile.TemporaryDirectory() as run_dir:
        engine = Engine(activation_checkpointing=checkpointing, activation_offload=offload, logging={"dir": run_dir})
        torch.manual_seed(0)
        model = GPT(MODEL)
        engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn=lm_loss)
        batch = _batch(MODEL, SEQ_LEN)
        engine.train_step(batch)  # optimizer states exist from here on
        between_steps = current_rss_bytes()
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset the peak resident set size (VmHWM)
        for _ in range(3):
            engine.train_step(batch)
        peak = _peak_rss_since_reset()
        with engine.activation_report() as report:
            engine.train_step(batch)
        engine.end()
    return {"report": report.as_dict(), "peak_rss_over_steady_mb": (peak - between_steps) / 1e6}


def timing(rounds: int) -> dict[str, float]:
    """Median over rounds of (mode's step time / none's step time), all modes in this one process."""
    runs = {}
    for mode, (checkpointing, offload) in MODES.items():
        torch.manual_seed(0)
        model = GPT(MODEL)
        apply_activation_checkpointing(model, ActivationCheckpointConfig(**checkpointing), offload, torch.device("cpu"))
        runs[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    inputs, targets = _batch(MODEL, SEQ_LEN)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(rounds + 2):
        for mode, (model, optimizer) in runs.items():
            start = time.perf_counter()
            lm_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            if round_index >= 2:  # two warm-up rounds
                times[mode].append(time.perf_counter() - start)
    return {
        mode: statistics.median(t / base for t, base in zip(times[mode], times["none"], strict=True)) for mode in MODES
    } | {"none_step_s": statistics.median(times["none"])}


def overlap_worker(rounds: int, out: Path) -> None:
    """World 2, one process group, interleaved: DDP with default buckets against one model-sized bucket, and
    FSDP with torch's default prefetching against explicit prefetching of the next two blocks."""
    with tempfile.TemporaryDirectory() as run_dir:
        engine = Engine(logging={"dir": run_dir}, hang_doctor=False, zero_stage=3)  # its mesh: 2 shards
        builders = {
            "ddp default buckets": lambda m: apply_ddp(m, engine.mesh, DDPConfig()),
            "ddp one bucket": lambda m: apply_ddp(m, engine.mesh, DDPConfig(bucket_cap_mb=100_000.0)),
            "fsdp default prefetch": lambda m: apply_fsdp(m, engine.mesh, ShardingConfig(zero_stage=3), "no"),
            "fsdp prefetch 2": lambda m: apply_fsdp(
                m, engine.mesh, ShardingConfig(zero_stage=3, forward_prefetch=2, backward_prefetch=2), "no"
            ),
        }
        models = {}
        for name, build in builders.items():
            torch.manual_seed(0)
            model = build(GPT(OVERLAP_MODEL))
            models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        inputs, targets = _batch(OVERLAP_MODEL, 128, seed=engine.process_index)
        times: dict[str, list[float]] = {name: [] for name in models}
        for round_index in range(rounds + 2):
            for name, (model, optimizer) in models.items():
                dist.barrier()
                start = time.perf_counter()
                lm_loss(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if round_index >= 2:
                    times[name].append(elapsed.item())
        if engine.is_main_process:

            def ratio(name: str, base: str) -> float:
                return statistics.median(t / b for t, b in zip(times[name], times[base], strict=True))

            out.write_text(
                json.dumps(
                    {
                        "params": sum(p.numel() for p in GPT(OVERLAP_MODEL).parameters()),
                        "one_bucket_step_s": statistics.median(times["ddp one bucket"]),
                        "default_over_one_bucket": ratio("ddp default buckets", "ddp one bucket"),
                        "fsdp_default_step_s": statistics.median(times["fsdp default prefetch"]),
                        "fsdp_prefetch_over_default": ratio("fsdp prefetch 2", "fsdp default prefetch"),
                    }
                )
            )
        engine.end()


def korthikanti_bytes(mode: str) -> float:
    """The paper's bytes per layer (mean over the blocks), values at 4 bytes (fp32), no dropout masks (the model
    has none). Offload moves the same bytes, so it is counted like none."""
    checkpointing, _ = MODES[mode]
    every = checkpointing.get("every", 1)
    per_layer = []
    for index in range(MODEL.n_layers):
        recompute = checkpointing["mode"] if index % every == 0 else "none"
        per_layer.append(
            layer_activation_bytes(
                s=SEQ_LEN,
                b=MICRO_BATCH,
                h=MODEL.dim,
                a=MODEL.n_heads,
                element=4,
                tp=1,
                sp=False,
                recompute=recompute,
                dropout=False,
            )  # fmt: skip
        )
    return statistics.fmean(per_layer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/activation.json"))
    parser.add_argument("--memory-child", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--overlap-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child)))
        return 0
    if args.overlap_worker:
        overlap_worker(args.rounds, args.overlap_worker)
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    memory = {}
    for mode in MODES:
        done = subprocess.run(
            [sys.executable, __file__, "--memory-child", mode], env=env, capture_output=True, text=True, check=True
        )
        memory[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    ratios = timing(args.rounds)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "overlap.json"
        argv = ("--rounds", str(args.rounds), "--overlap-worker", str(out))
        code = launch(LaunchTarget(os.path.abspath(__file__), argv), LaunchPlan(LaunchSettings(nproc_per_node=2)))
        if code:
            return code
        overlap = json.loads(out.read_text())
    report(memory, ratios, overlap, args.out)
    return 0


def report(memory: dict, ratios: dict, overlap: dict, out: Path) -> None:
    none = memory["none"]["report"]
    rows = []
    for mode in MODES:
        measured = memory[mode]["report"]
        blocks = measured["blocks"]
        rows.append(
            {
                "mode": mode,
                "saved_mb": measured["saved_bytes"] / 1e6,
                "peak_saved_mb": measured["peak_bytes"] / 1e6,
                "per_block_mb": statistics.fmean(b["saved_bytes"] for b in blocks.values()) / 1e6,
                "korthikanti_per_block_mb": korthikanti_bytes(mode) / 1e6,
                "saved_fraction": 1 - measured["saved_bytes"] / none["saved_bytes"],
                "peak_saved_fraction": 1 - measured["peak_bytes"] / none["peak_bytes"],
                "peak_rss_over_steady_mb": memory[mode]["peak_rss_over_steady_mb"],
                "step_vs_none": ratios[mode],
            }
        )
    result = {
        "benchmark": "activation checkpointing, offload and DDP overlap",
        "model": MODEL.model_dump(),
        "micro_batch": MICRO_BATCH,
        "seq_len": SEQ_LEN,
        "none_step_s": ratios["none_step_s"],
        "rows": rows,
        "overlap": overlap,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nreference GPT dim {MODEL.dim}, {MODEL.n_layers} blocks, s {SEQ_LEN}, b {MICRO_BATCH}, fp32 (MB, 1e6 B)")
    print(
        f"{'mode':<11}{'saved':>8}{'saved%':>8}{'peak':>8}{'peak%':>8}{'/block':>8}{'formula':>9}"
        f"{'peak rss+':>11}{'step/none':>11}"
    )
    for row in rows:
        print(
            f"{row['mode']:<11}{row['saved_mb']:>8.1f}{row['saved_fraction']:>8.0%}{row['peak_saved_mb']:>8.1f}"
            f"{row['peak_saved_fraction']:>8.0%}{row['per_block_mb']:>8.2f}{row['korthikanti_per_block_mb']:>9.2f}"
            f"{row['peak_rss_over_steady_mb']:>11.1f}{row['step_vs_none']:>11.3f}"
        )
    print(
        f"DDP world 2, {overlap['params']:,} params: default buckets / one bucket after backward = "
        f"{overlap['default_over_one_bucket']:.3f} (one bucket: {overlap['one_bucket_step_s']:.3f} s/step)"
    )
    print(
        f"FSDP world 2: forward/backward prefetch of 2 blocks / torch's default = "
        f"{overlap['fsdp_prefetch_over_default']:.3f} (default: {overlap['fsdp_default_step_s']:.3f} s/step)"
    )
    print(f"written to {out}")


if __name__ == "__main__":
    sys.exit(main())
