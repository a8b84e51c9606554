"""How a training step runs, as far as its memory goes: the attention kernel, torch.compile, the loss, the
optimizer's step and how 16-bit training keeps its weights. The estimator (`estimate.py`) reads it.

Measured on one NVIDIA H200 (torch 2.11, bf16 autocast, fused AdamW, SDPA, torch.compile; BENCHMARKS.md, "The
memory estimate on a GPU"), a 1.1 B Llama-shaped model's peak `max_memory_allocated` follows these terms: the
fp32 weights and Adam's moments; the bf16 copies autocast makes of the weights, kept for backward by each matrix
product; the activations as the compiled step keeps them (inductor recomputes pointwise results in backward);
three fp32 logits-sized tensors while the loss runs backward; and, where the step outweighs backward (full
recomputation), the gradients with one recomputed layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossKind = Literal["plain", "fused"]
OptimizerStep = Literal["foreach", "fused"]
WeightsKept = Literal["autocast", "master"]


@dataclass(frozen=True)
class StepRecipe:
    """`attention`: transformers' name (`sdpa`, `eager`, `flash_attention_2`, ...): eager keeps each layer's
    [heads, seq, seq] probabilities, fused kernels a log-sum-exp per head. `compiled`: torch.compile (inductor).
    `loss`: plain (whole logits) or fused (a chunk at a time). `optimizer_step`: torch's default foreach Adam builds
    one temporary the size of its states' moment; fused (and for-loop) steps none. `weights`: autocast = fp32
    weights cast to 16 bits in each forward (meshkit's Engine: 4+4+8 bytes per parameter and 2 more for the copies);
    master = 16-bit weights with an fp32 master copy in the optimizer (DeepSpeed, Megatron: 2+2+12).
    `tiled_mlp`: each dense MLP runs under checkpointing over slices of the sequence (about h tokens each, as
    `tiled_mlp_shards` defaults): it keeps only its input, and backward recomputes one slice at a time.
    `allocator_allowance`: the share added for the caching allocator's rounding and kernel workspaces."""

    attention: str = "sdpa"
    compiled: bool = False
    loss: LossKind = "plain"
    optimizer_step: OptimizerStep = "foreach"
    weights: WeightsKept = "autocast"
    tiled_mlp: bool = False
    allocator_allowance: float = 0.02

    @property
    def keeps_scores(self) -> bool:
        # (imported here: the estimator itself needs neither torch nor DTensor; the models' modules bring both)
        from meshkit.models.attention_kind import stores_scores

        return stores_scores(self.attention)

    def describe(self) -> str:
        loss = "fused loss (chunks of logits)" if self.loss == "fused" else "plain loss (whole logits)"
        parts = [f"attention {self.attention}", "torch.compile" if self.compiled else "not compiled"]
        parts += [loss, f"{self.optimizer_step} optimizer step", f"{self.weights} weights"]
        parts += ["tiled MLPs"] if self.tiled_mlp else []
        return ", ".join(parts)


def loss_bytes(
    tokens: float,
    vocab: int | None,
    hidden: int | None,
    tp: int,
    loss: LossKind,
    logits_element: int = 4,
    head_trained: bool = True,
) -> tuple[float, str]:
    """(bytes, formula) the loss holds while it runs backward. Plain: the logits the model returned (alive until
    backward ends, `logits_element` bytes each: 2 under 16-bit autocast) and three fp32 tensors of their size
    (log-probabilities, their gradient, the logits' gradient). Fused (`fused_cross_entropy`): one chunk of tokens'
    fp32 logits (their softmax and gradient computed in place; under 16-bit compute the product before its cast
    too), and the fp32 weight gradient the forward computes for backward (V/tp·h) where the head trains (not under
    adapters: `head_trained=False`)."""
    if not vocab:
        return 0.0, ""
    rows = vocab / tp
    if loss == "fused":
        from meshkit.training.fused_cross_entropy import chunk_tokens  # (as `keeps_scores`: no torch up front)

        chunk = chunk_tokens(int(rows), hidden or 1, max(1, int(tokens)))
        per_logit = 4 + (2 if logits_element == 2 else 0)  # (16-bit: the product before its fp32 cast)
        weight_grad = 4 * rows * (hidden or 0) if head_trained else 0.0
        head = " + 4·V/tp·h (the head's weight gradient, from forward to backward)" if head_trained else ""
        return (per_logit * rows * chunk + weight_grad, f" + fused loss: {per_logit}·V/tp for {chunk} tokens (their"
                f" fp32 logits, turned into their gradient in place){head}")  # fmt: skip
    per_token = logits_element + 3 * 4
    return per_token * rows * tokens, (
        f" + loss: s·b·{per_token}·V/tp (the logits ({logits_element} B), fp32 log-probs, their gradient, the "
        "logits' gradient)"
    )
