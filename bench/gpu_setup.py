"""What every row of the GPU check (`bench/gpu_check.py`) shares: the shape it runs, the device's clock and memory
readings, timed training steps."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshkit.models.gpt import GPT, GPTConfig
from meshkit.planning.estimate import ModelShape
from meshkit.planning.perf_model import flops_per_token

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


def reset_dynamo() -> None:
    """Forget compiled code and dynamo's counters, so the next row's graphs and breaks are its own."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def dynamo_counts() -> dict[str, int]:
    """Graphs dynamo compiled and graph breaks it met since `reset_dynamo()`."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
