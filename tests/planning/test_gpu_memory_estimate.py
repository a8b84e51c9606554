"""The estimator against peaks measured on a GPU (`torch.cuda.max_memory_allocated`, one NVIDIA H200, torch 2.11
+ CUDA 13, bf16 autocast, fused AdamW, SDPA, torch.compile; `bench/estimate_vs_gpu.py` holds them and their
sources, BENCHMARKS.md shows them): each within ±10 % from the shapes and the step's recipe alone."""

from __future__ import annotations

import pytest

from bench.estimate_vs_gpu import LLAMA_1B, MEASURED, estimate_gb
from meshkit.planning.estimate import estimate_memory
from meshkit.planning.step_recipe import StepRecipe


@pytest.mark.parametrize("peak", MEASURED, ids=lambda p: f"{p.model_name}-{p.micro_batch}x{p.seq_len}-{p.recompute}")
def test_within_10_percent_of_the_measured_gpu_peak(peak) -> None:
    assert estimate_gb(peak) == pytest.approx(peak.measured_gb, rel=0.10)


def test_scores_are_counted_only_where_the_attention_keeps_them() -> None:
    """Eager attention keeps each layer's [heads, seq, seq] probabilities; SDPA's and flash kernels a log-sum-exp:
    at 2048 tokens the difference is 32 heads × 2048 × 2 bytes per token and layer."""
    args = {"seq_len": 2048, "micro_batch": 8, "precision": "bf16"}
    fused = estimate_memory(LLAMA_1B, **args, recipe=StepRecipe(attention="sdpa"))
    eager = estimate_memory(LLAMA_1B, **args, recipe=StepRecipe(attention="eager"))
    flash = estimate_memory(LLAMA_1B, **args, recipe=StepRecipe(attention="flash_attention_2"))
    assert flash.gb("activations") == fused.gb("activations")
    grown = (eager.gb("activations") - fused.gb("activations")) * 1e9 / (16 * 8 * 2048)
    assert grown == pytest.approx(2 * (32 * 2048 + 2 * (2048 - 512)) - 4 * 32, rel=1e-6)
    assert "a·s probabilities" in eager.as_json()["formulas"]["activations"]


def test_the_compiled_step_keeps_less_and_the_fused_loss_drops_the_logits() -> None:
    args = {"seq_len": 2048, "micro_batch": 8, "precision": "bf16"}
    eager = estimate_memory(LLAMA_1B, **args)
    compiled = estimate_memory(LLAMA_1B, **args, recipe=StepRecipe(compiled=True))
    assert compiled.gb("activations") < 0.85 * eager.gb("activations")
    # the bf16 logits, fp32 log-probs, their gradient, the logits' gradient
    plain_loss = (2 + 3 * 4) * 32000 * 8 * 2048 / 1e9
    fused = estimate_memory(LLAMA_1B, **args, recipe=StepRecipe(loss="fused"))
    # one chunk of 2048 tokens (at least the hidden size) at a time, and the head's fp32 weight gradient
    chunk = ((4 + 2) * 32000 * 2048 + 4 * 32000 * 2048) / 1e9  # (fp32 logits in place, the bf16 product)
    assert eager.gb("activations") - fused.gb("activations") == pytest.approx(plain_loss - chunk, rel=1e-6)
    assert "fused loss" in fused.as_json()["formulas"]["activations"]
