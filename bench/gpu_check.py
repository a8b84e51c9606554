"""The GPU check: what meshkit does on one accelerator, in one run of at most ~8 minutes, no network.

Rows (each a ratio or a figure from this run):
- engine: a ~1.1 B Llama-shaped reference GPT (TinyLlama's shape) through the Engine — bf16 autocast, fused AdamW,
  regional `torch.compile`, SDPA (flash) attention: tokens/s, MFU against the device's bf16 peak, peak memory;
- torch: the same step as a plain torch loop (the engine's ratio to it);
- fsdp2: the same model under torch's `fully_shard` (what zero_stage 3 applies) in a world of one;
- fp8: float8 matmuls through torchao (`convert_to_float8_training`), on GPUs with fp8 tensor cores;
- fused loss: cross-entropy from hidden states × a 128k-vocabulary head, fused (`meshkit.training.
  fused_cross_entropy`) against the plain logits + cross-entropy: peak memory, time, agreement;
- finetune: a Llama-3.2-1B-shaped transformers model (128k vocabulary) on HF batches through the Engine, with the
  fused loss (`fused_loss: auto`) and without (`off`): tokens/s and peak memory;
- estimator: `meshkit estimate`'s prediction for the engine row against its measured peak.

Off a GPU every row that can still run does, on a tiny shape (so CI keeps the script alive); rows that need a
GPU say why they are skipped. Prints a table and writes JSON.

    python bench/gpu_check.py [--out bench/results/gpu-check.json] [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshkit import Engine  # noqa: E402
from meshkit.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from meshkit.planning.estimate import ModelShape, estimate_memory  # noqa: E402
from meshkit.planning.hardware import PRESETS  # noqa: E402
from meshkit.planning.perf_model import flops_per_token  # noqa: E402
from meshkit.training.fused_cross_entropy import CHUNK_BYTES, fused_linear_cross_entropy  # noqa: E402

Row = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    """The model and batch every training row uses, and the fused-loss row's sizes."""

    model: GPTConfig
    micro_batch: int
    seq_len: int
    warmup: int
    steps: int
    compile: bool
    loss_tokens: int
    loss_vocab: int


def shape_for(device: torch.device, steps: int) -> Shape:
    if device.type == "cuda":  # TinyLlama 1.1B
        model = GPTConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
                          max_seq_len=2048)  # fmt: skip
        return Shape(model, 8, 2048, 5, steps, True, 16384, 128256)
    model = GPTConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    return Shape(model, 2, 64, 1, 2, False, 256, 8192)


@dataclass
class Context:
    device: torch.device
    shape: Shape
    peak_flops: float | None
    measured: dict[str, Any]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def batches(ctx: Context, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shape = ctx.shape
    tokens = torch.randint(0, shape.model.vocab_size, (count, shape.micro_batch, shape.seq_len + 1),
                           generator=generator)  # fmt: skip
    return [(row[:, :-1].to(ctx.device), row[:, 1:].to(ctx.device)) for row in tokens]


def timed_steps(ctx: Context, step: Callable[[tuple[torch.Tensor, torch.Tensor]], Any]) -> Row:
    """Warm-up steps (compilation happens there), then timed ones: tokens/s, MFU, peak memory."""
    shape = ctx.shape
    data = batches(ctx, shape.warmup + shape.steps)
    for batch in data[: shape.warmup]:
        step(batch)
    synchronize(ctx.device)
    seconds = []
    for batch in data[shape.warmup :]:
        start = time.perf_counter()
        step(batch)
        synchronize(ctx.device)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    tokens = shape.micro_batch * shape.seq_len
    flops = sum(flops_per_token(ModelShape.from_gpt(shape.model), shape.seq_len)) * tokens
    row: Row = {"step_s": median, "tokens_per_s": tokens / median, "peak_gb": peak_gb(ctx.device)}
    row["mfu"] = flops / median / ctx.peak_flops if ctx.peak_flops else None
    return row


def new_model(ctx: Context) -> GPT:
    torch.manual_seed(0)
    return GPT(ctx.shape.model)


def optimizer_for(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def engine_row(ctx: Context) -> Row:
    fresh_memory(ctx.device)
    model = new_model(ctx)
    optimizer = optimizer_for(model.to(ctx.device), ctx.device)
    row = engine_steps(ctx, model, optimizer)
    ctx.measured["engine"] = row
    return row


def engine_steps(ctx: Context, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Row:
    """Timed steps through the Engine (bf16, regional compile where the shape asks), which then ends."""
    compiled = {"enabled": True, "regional": True}
    engine = Engine(precision="bf16", compile=compiled) if ctx.shape.compile else Engine(precision="bf16")
    try:
        model, optimizer = engine.prepare(model, optimizer, loss_fn=lm_loss)
        return timed_steps(ctx, engine.train_step)
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


def _loss_run(
    ctx: Context, fused: bool, chunk_bytes: int = CHUNK_BYTES, repeats: int = 3
) -> tuple[float, list[torch.Tensor], float, float]:
    """(loss, gradients, seconds, peak GB above the inputs) of one forward and backward of the head's loss."""
    shape, device = ctx.shape, ctx.device
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(shape.loss_tokens, shape.model.dim, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(shape.loss_vocab, shape.model.dim, generator=generator) * 0.02).to(device).requires_grad_()
    targets = torch.randint(0, shape.loss_vocab, (shape.loss_tokens,), generator=generator).to(device)
    seconds, peak = [], 0.0
    loss = torch.zeros(())
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        fresh_memory(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if fused:
                loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_bytes=chunk_bytes)
            else:
                loss = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
        loss.backward()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated(device) - base) / 1e9
    assert hidden.grad is not None and weight.grad is not None
    return float(loss.detach()), [hidden.grad, weight.grad], statistics.median(seconds), peak


def fused_loss_row(ctx: Context) -> Row:
    plain_loss, plain_grads, plain_s, plain_peak = _loss_run(ctx, fused=False)
    fused_loss, fused_grads, fused_s, fused_peak = _loss_run(ctx, fused=True)
    _, _, large_chunk_s, large_chunk_peak = _loss_run(ctx, fused=True, chunk_bytes=8 * CHUNK_BYTES)
    grad_error = max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
        for a, b in zip(fused_grads, plain_grads, strict=True)
    )
    row: Row = {
        "tokens": ctx.shape.loss_tokens,
        "vocab": ctx.shape.loss_vocab,
        "hidden": ctx.shape.model.dim,
        "loss_relative_error": abs(fused_loss - plain_loss) / abs(plain_loss),
        "grad_relative_error": grad_error,
        "time_vs_plain": fused_s / plain_s,
        "time_vs_plain_8x_chunk": large_chunk_s / plain_s,
        "fused_peak_gb_8x_chunk": large_chunk_peak if ctx.device.type == "cuda" else None,
        "plain_peak_gb": plain_peak if ctx.device.type == "cuda" else None,
        "fused_peak_gb": fused_peak if ctx.device.type == "cuda" else None,
    }
    if ctx.device.type == "cuda":
        row["peak_vs_plain"] = fused_peak / plain_peak
    return row


def _finetune_steps(ctx: Context, fused: str) -> Row:
    """Steps of a Llama-3.2-1B-shaped transformers model (128k vocabulary, tied head) on HF batches through the
    Engine: the causal-LM loss fused (`fused_loss: auto`) or from the logits (`off`); bf16, no compile."""
    import transformers

    cuda = ctx.device.type == "cuda"
    size = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256) if cuda else dict(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=8192)  # fmt: skip
    micro_batch, seq = (4, 2048) if cuda else (2, 64)
    fresh_memory(ctx.device)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**size, tie_word_embeddings=True, max_position_embeddings=seq)
    model = transformers.LlamaForCausalLM(config).to(ctx.device)
    engine = Engine(precision="bf16", fused_loss=fused)
    try:
        model, optimizer = engine.prepare(model, optimizer_for(model, ctx.device))
        assert (engine.ctx.objects.fused_head is not None) is (fused == "auto")
        generator = torch.Generator().manual_seed(0)
        steps = [
            torch.randint(0, config.vocab_size, (micro_batch, seq), generator=generator)
            for _ in range(4 + ctx.shape.steps // 2)
        ]
        seconds = []
        for index, ids in enumerate(steps):
            ids = ids.to(ctx.device)
            synchronize(ctx.device)
            start = time.perf_counter()
            loss = engine.train_step({"input_ids": ids, "labels": ids})
            synchronize(ctx.device)
            if index >= 3:
                seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        return {"step_s": median, "tokens_per_s": micro_batch * seq / median, "peak_gb": peak_gb(ctx.device),
                "loss": float(loss)}  # fmt: skip
    finally:
        engine.end()


def finetune_row(ctx: Context) -> Row:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed (pip install 'meshkit[hf]')"}
    plain = _finetune_steps(ctx, "off")
    fused = _finetune_steps(ctx, "auto")
    row: Row = {f"plain_{key}": value for key, value in plain.items()}
    row.update({f"fused_{key}": value for key, value in fused.items()})
    row["time_vs_plain"] = fused["step_s"] / plain["step_s"]
    if plain["peak_gb"]:
        row["peak_vs_plain"] = fused["peak_gb"] / plain["peak_gb"]
    return row


def estimator_row(ctx: Context) -> Row:
    shape = ctx.shape
    estimate = estimate_memory(ModelShape.from_gpt(shape.model), seq_len=shape.seq_len, micro_batch=shape.micro_batch,
                               precision="bf16", optimizer="adam")  # fmt: skip
    predicted = estimate.total_gb
    measured = (ctx.measured.get("engine") or {}).get("peak_gb")
    row: Row = {"predicted_gb": predicted, "measured_gb": measured}
    row["predicted_vs_measured"] = predicted / measured if measured else None
    if measured is None:
        row["note"] = "measured peak is read from the CUDA allocator: GPU only"
    return row


ROWS: dict[str, Callable[[Context], Row]] = {
    "engine": engine_row,
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
        f"{data['micro_batch']} × seq {data['seq_len']}, bf16 autocast, fused AdamW, regional compile "
        f"{'on' if data['compile'] else 'off'}; MFU against {data['peak_tflops'] or '?'} TFLOP/s bf16 dense.\n\n"
        "| row | figures |\n|---|---|"
    )
    rows = [f"| {name} | {format_row({k: v for k, v in row.items() if k != 'wall_s'})} |"
            for name, row in data["rows"].items()]  # fmt: skip
    return "\n".join([head, *rows])


if __name__ == "__main__":
    raise SystemExit(main())
