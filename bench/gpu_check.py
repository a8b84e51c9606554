"""The GPU check: what meshkit does on one accelerator, in one run of at most ~8 minutes, no network.

Rows (each a ratio or a figure from this run):
- engine: a ~1.1 B Llama-shaped reference GPT (TinyLlama's shape) through the Engine — bf16 autocast, fused AdamW,
  `torch.compile` as the layout picks, SDPA (flash) attention: tokens/s, MFU against the device's bf16 peak, peak
  memory, where it ran (device, backend, attention), dynamo's graphs and graph breaks;
- whole compile: the same with the whole model compiled: step time against per block, graphs and breaks;
- full recompute: the same with full activation checkpointing (its peak, for the estimator);
- torch: the same step as a plain torch loop (the engine's ratio to it);
- fsdp2: the same model under torch's `fully_shard` (what zero_stage 3 applies) in a world of one;
- fp8: float8 matmuls through torchao (`convert_to_float8_training`), on GPUs with fp8 tensor cores;
- fused loss: cross-entropy from hidden states × a 128k-vocabulary head, fused (`meshkit.training.
  fused_cross_entropy`) against the plain logits + cross-entropy: peak memory, time, agreement;
- finetune: a Llama-3.2-1B-shaped transformers model (128k vocabulary) on HF batches through the Engine, with the
  fused loss (`fused_loss: auto`) and without (`off`): tokens/s and peak memory, eager and (on a GPU) with the whole
  model compiled, each with the loss path and compile's graphs and breaks from the run's own record;
- estimator: `meshkit estimate`'s prediction (the compiled recipe) against the engine and full-recompute peaks.

The loss rows live in `bench/gpu_loss_rows.py`, what every row shares in `bench/gpu_setup.py`.
Off a GPU every row that can still run does, on a tiny shape (so CI keeps the script alive); rows that need a
GPU say why they are skipped. Prints a table and writes JSON.

    python bench/gpu_check.py [--out bench/results/gpu-check.json] [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_loss_rows import finetune_row, fused_loss_row  # noqa: E402
from bench.gpu_setup import (  # noqa: E402
    Context,
    Row,
    dynamo_counts,
    fresh_memory,
    new_model,
    optimizer_for,
    reset_dynamo,
    shape_for,
    timed_steps,
)
from meshkit import Engine  # noqa: E402
from meshkit.engine.where_it_runs import where_it_runs  # noqa: E402
from meshkit.models.gpt import GPT, lm_loss  # noqa: E402
from meshkit.planning.estimate import ModelShape, estimate_memory  # noqa: E402
from meshkit.planning.hardware import PRESETS  # noqa: E402
from meshkit.planning.step_recipe import StepRecipe  # noqa: E402


def engine_row(ctx: Context) -> Row:
    fresh_memory(ctx.device)
    model = new_model(ctx)
    optimizer = optimizer_for(model.to(ctx.device), ctx.device)
    row = engine_steps(ctx, model, optimizer)
    ctx.measured["engine"] = row
    return row


def whole_compile_row(ctx: Context) -> Row:
    """The engine row with the whole model compiled (`compile.regional: false`): its step time against per block,
    and dynamo's graphs and breaks for each way (per block is what the layout picks under sharding hooks)."""
    if not ctx.shape.compile:
        return {"skipped": "compile is off for this shape (CPU): nothing to compare"}
    fresh_memory(ctx.device)
    model = new_model(ctx)
    row = engine_steps(ctx, model, optimizer_for(model.to(ctx.device), ctx.device), regional=False)
    blocks = ctx.measured.get("engine")
    row["vs_per_block"] = row["step_s"] / blocks["step_s"] if blocks and "step_s" in blocks else None
    return row


def full_recompute_row(ctx: Context) -> Row:
    """The engine row with full activation checkpointing: peak memory for the estimator row."""
    fresh_memory(ctx.device)
    model = new_model(ctx)
    row = engine_steps(ctx, model, optimizer_for(model.to(ctx.device), ctx.device), recompute="full")
    ctx.measured["full recompute"] = row
    return row


def engine_steps(
    ctx: Context, model: torch.nn.Module, optimizer: torch.optim.Optimizer, regional: bool | None = None,
    recompute: str = "none",
) -> Row:  # fmt: skip
    """Timed steps through the Engine (bf16; compile as the layout picks, or as `regional` says), which then ends;
    with where it ran and dynamo's graphs and breaks."""
    reset_dynamo()
    settings: dict[str, Any] = {"precision": "bf16", "activation_checkpointing": {"mode": recompute}}
    if ctx.shape.compile:
        settings["compile"] = {"enabled": True, "regional": regional}
    engine = Engine(**settings)
    try:
        model, optimizer = engine.prepare(model, optimizer, loss_fn=lm_loss)
        row = timed_steps(ctx, engine.train_step)
        return row | where_it_runs(engine) | {"compile": engine.ctx.objects.compiled} | dynamo_counts()
    finally:
        engine.end()


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> Callable:
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def compile_blocks(model: GPT, enabled: bool) -> None:
    if enabled:
        for block in model.layers:
            block.compile()


def torch_row(ctx: Context) -> Row:
    fresh_memory(ctx.device)
    model = new_model(ctx).to(ctx.device)
    compile_blocks(model, ctx.shape.compile)
    row = timed_steps(ctx, plain_step(model, optimizer_for(model, ctx.device), ctx.device))
    ctx.measured["torch"] = row
    engine = ctx.measured.get("engine")
    row["engine_vs_torch"] = engine["step_s"] / row["step_s"] if engine else None
    return row


def single_process_group(device: torch.device) -> None:
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def fsdp_row(ctx: Context) -> Row:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fresh_memory(ctx.device)
    single_process_group(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = new_model(ctx).to(ctx.device)
    compile_blocks(model, ctx.shape.compile)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    try:
        row = timed_steps(ctx, plain_step(model, optimizer_for(model, ctx.device), ctx.device))
    finally:
        dist.destroy_process_group()
    plain = ctx.measured.get("torch")
    row["vs_torch"] = row["step_s"] / plain["step_s"] if plain else None
    return row


def fp8_row(ctx: Context) -> Row:
    if ctx.device.type != "cuda":
        return {"skipped": "float8 matmuls need a GPU with fp8 tensor cores"}
    if torch.cuda.get_device_capability(ctx.device) < (8, 9):
        return {"skipped": f"{torch.cuda.get_device_name(ctx.device)} has no fp8 tensor cores (needs sm_89+)"}
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as error:
        return {"skipped": f"torchao is not installed ({error}): pip install torchao"}
    fresh_memory(ctx.device)
    model = new_model(ctx).to(ctx.device)
    convert_to_float8_training(model, module_filter_fn=lambda module, name: name != "output")
    row = engine_steps(ctx, model, optimizer_for(model, ctx.device))
    bf16 = ctx.measured.get("engine")
    row["speedup_vs_bf16"] = bf16["step_s"] / row["step_s"] if bf16 else None
    return row


def estimator_row(ctx: Context) -> Row:
    """`meshkit estimate` for the engine rows' shape and recipe (compiled, SDPA, plain loss, fused AdamW on a GPU)
    against their measured peaks, without and with full recomputation."""
    shape = ctx.shape
    recipe = StepRecipe(compiled=shape.compile, optimizer_step="fused" if ctx.device.type == "cuda" else "foreach")
    row: Row = {}
    for measured_row, recompute in (("engine", "none"), ("full recompute", "full")):
        estimate = estimate_memory(ModelShape.from_gpt(shape.model), seq_len=shape.seq_len,
                                   micro_batch=shape.micro_batch, precision="bf16", optimizer="adam",
                                   activation_checkpointing=recompute, recipe=recipe)  # fmt: skip
        measured = (ctx.measured.get(measured_row) or {}).get("peak_gb")
        key = "" if recompute == "none" else "full_"
        row[f"{key}predicted_gb"], row[f"{key}measured_gb"] = estimate.total_gb, measured
        row[f"{key}predicted_vs_measured"] = estimate.total_gb / measured if measured else None
    if row["measured_gb"] is None:
        row["note"] = "measured peak is read from the CUDA allocator: GPU only"
    return row


ROWS: dict[str, Callable[[Context], Row]] = {
    "engine": engine_row,
    "whole compile": whole_compile_row,
    "full recompute": full_recompute_row,
    "torch": torch_row,
    "fused loss": fused_loss_row,
    "finetune": finetune_row,
    "estimator": estimator_row,
    "fsdp2": fsdp_row,
    "fp8": fp8_row,
}


def device_facts(device: torch.device) -> tuple[str, float | None]:
    """The device's name and its bf16 dense peak (FLOP/s) where a hardware preset knows it."""
    if device.type != "cuda":
        return platform.processor() or "cpu", None
    name = torch.cuda.get_device_name(device)
    for preset in PRESETS.values():
        if preset.name.lower() in name.lower():
            return name, preset.peak_tflops * 1e12
    return name, None


def commit() -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu-check.json"))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per training row (GPU)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    name, peak = device_facts(device)
    ctx = Context(device, shape_for(device, args.steps), peak, {})
    print(f"gpu check on {name} ({device}), torch {torch.__version__}, rows: {args.rows}", flush=True)
    results: dict[str, Row] = {}
    failed = False
    for row_name in args.rows.split(","):
        start = time.perf_counter()
        try:
            results[row_name] = ROWS[row_name](ctx)
        except Exception as error:  # a row that breaks is recorded; the others still run
            failed = True
            results[row_name] = {"error": f"{type(error).__name__}: {error}"}
            traceback.print_exc()
        results[row_name]["wall_s"] = time.perf_counter() - start
        print(f"{row_name:>12}: {format_row(results[row_name])}", flush=True)
        write(args.out, ctx, name, results)  # after every row: a run cut short keeps what it measured
    print(f"wrote {args.out}")
    return 1 if failed else 0


def write(out: Path, ctx: Context, device_name: str, results: dict[str, Row]) -> None:
    shape = ctx.shape
    data = {
        "device": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "model": shape.model.model_dump(),
        "micro_batch": shape.micro_batch,
        "seq_len": shape.seq_len,
        "compile": shape.compile,
        "peak_tflops": ctx.peak_flops / 1e12 if ctx.peak_flops else None,
        "rows": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")


def format_row(row: Row) -> str:
    parts = []
    for key, value in row.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif value is not None:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def section(data: dict[str, Any]) -> str:
    """The BENCHMARKS.md table (`bench/report.py`): each row's figures, as measured."""
    model = data["model"]
    head = (
        f"Device: {data['device']}, torch {data['torch']} (CUDA {data['cuda']}), working tree of {data['commit']}. "
        f"Model: reference GPT, dim {model['dim']}, {model['n_layers']} layers, {model['n_heads']} heads "
        f"({model['n_kv_heads']} kv), SwiGLU {model['ffn_hidden']}, vocab {model['vocab_size']}; micro-batch "
        f"{data['micro_batch']} × seq {data['seq_len']}, bf16 autocast, fused AdamW, compile "
        f"{'on' if data['compile'] else 'off'}; MFU against {data['peak_tflops'] or '?'} TFLOP/s bf16 dense.\n\n"
        "| row | figures |\n|---|---|"
    )
    rows = [f"| {name} | {format_row({k: v for k, v in row.items() if k != 'wall_s'})} |"
            for name, row in data["rows"].items()]  # fmt: skip
    return "\n".join([head, *rows])


if __name__ == "__main__":
    raise SystemExit(main())
