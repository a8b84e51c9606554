"""The GPU check's loss rows (`bench/gpu_check.py`): the fused loss against the logits' cross-entropy on one head,
and a Llama-3.2-1B-shaped transformers model fine-tuned with and without it through the Engine."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from bench.gpu_setup import Context, Row, fresh_memory, optimizer_for, peak_gb, synchronize
from meshkit import Engine
from meshkit.training.fused_cross_entropy import CHUNK_BYTES, fused_linear_cross_entropy


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
    # chunks of 4 × hidden tokens (the default: at least 1 × hidden): what a larger chunk buys in time, costs in memory
    larger = 4 * ctx.shape.model.dim * 4 * ctx.shape.loss_vocab
    _, _, large_chunk_s, large_chunk_peak = _loss_run(ctx, fused=True, chunk_bytes=max(larger, CHUNK_BYTES))
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
        "time_vs_plain_4x_hidden_chunk": large_chunk_s / plain_s,
        "fused_peak_gb_4x_hidden_chunk": large_chunk_peak if ctx.device.type == "cuda" else None,
        "plain_peak_gb": plain_peak if ctx.device.type == "cuda" else None,
        "fused_peak_gb": fused_peak if ctx.device.type == "cuda" else None,
    }
    if ctx.device.type == "cuda":
        row["peak_vs_plain"] = fused_peak / plain_peak
    return row


def _finetune_steps(ctx: Context, fused: str, compiled: bool = False) -> Row:
    """Steps of a Llama-3.2-1B-shaped transformers model (128k vocabulary, tied head) on HF batches through the
    Engine: the causal-LM loss fused (`fused_loss: auto`) or from the logits (`off`); bf16, compiled (the whole
    model, as DDP and one process compile it) or not; with what the run's record says ran."""
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
    engine = Engine(precision="bf16", fused_loss=fused, compile={"enabled": compiled})
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
        from meshkit.engine.what_ran import what_ran

        ran = what_ran(engine)
        return {"step_s": median, "tokens_per_s": micro_batch * seq / median, "peak_gb": peak_gb(ctx.device),
                "loss": float(loss), "ran_loss": ran["loss"], "ran_compile": ran["compile"]}  # fmt: skip
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
    if ctx.device.type == "cuda":  # the whole compiled step both ways (on a CPU compiling costs minutes: skipped)
        compiled_plain = _finetune_steps(ctx, "off", compiled=True)
        compiled_fused = _finetune_steps(ctx, "auto", compiled=True)
        row.update({f"compiled_plain_{key}": value for key, value in compiled_plain.items()})
        row.update({f"compiled_fused_{key}": value for key, value in compiled_fused.items()})
        row["compiled_time_vs_plain"] = compiled_fused["step_s"] / compiled_plain["step_s"]
    return row
