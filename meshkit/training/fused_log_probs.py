"""Each token's log-probability of its target, straight from the last hidden states and the head weight, a chunk of
tokens at a time: what preference and reward objectives read (per-sequence sums of the completion's log-probs)
without the [tokens, vocab] logits of a pair ever existing whole.

Unlike the summed loss (`fused_cross_entropy`), the gradient arriving for each token is not known in the forward
(DPO weighs every row by its own margin), so the backward computes each chunk's logits again from the saved
hidden states and weight: softmax from the saved log-sum-exp, minus the one-hot target, times the token's incoming
gradient, then the same two products a plain head's backward runs. One more matrix product per chunk than the
logits path, in exchange for never holding more than one chunk's logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from meshkit.training.fused_cross_entropy import CHUNK_BYTES, add_chunk_gradients, chunk_tokens, compute_dtype
from meshkit.training.loss import IGNORE_INDEX


class _FusedTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [tokens, hidden]
        weight: torch.Tensor,  # [vocab, hidden]
        bias: torch.Tensor | None,  # [vocab]
        targets: torch.Tensor,  # [tokens]; IGNORE_INDEX: log-prob 0, no gradient
        chunk_bytes: int,
        with_squares: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(hidden.device, hidden.dtype)
        step = chunk_tokens(weight.shape[0], hidden.shape[1], hidden.shape[0], chunk_bytes)
        counted = targets != IGNORE_INDEX
        index = torch.where(counted, targets, 0)
        log_probs = torch.zeros(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        lse = torch.zeros_like(log_probs)
        squares = torch.zeros_like(log_probs) if with_squares else log_probs.new_zeros(0)
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for begin in range(0, hidden.shape[0], step):
                rows = slice(begin, begin + step)
                logits = F.linear(h[rows], w, b).float()  # [chunk, vocab]
                lse[rows] = torch.logsumexp(logits, dim=1)
                picked = logits.gather(1, index[rows].unsqueeze(1)).squeeze(1)
                log_probs[rows] = (picked - lse[rows]) * counted[rows]
                if with_squares:  # log Σ_v p(v)² = logsumexp(2z) − 2·logsumexp(z) (WPO's weights)
                    squares[rows] = torch.logsumexp(logits.mul_(2), dim=1) - 2 * lse[rows]
                del logits, picked  # (the next chunk's logits take their place rather than join them)
        ctx.save_for_backward(hidden, weight, bias, index, counted, lse)
        ctx.dtype, ctx.step = dtype, step
        ctx.mark_non_differentiable(squares)
        return log_probs, squares

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_squares: Any) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, index, counted, lse = ctx.saved_tensors
        dtype, step = ctx.dtype, ctx.step
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        scale = grad_out.float() * counted  # [tokens]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and want_bias else None
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for begin in range(0, hidden.shape[0], step):
                rows = slice(begin, begin + step)
                logits = F.linear(h[rows], w, b).float()
                # d log p(target) / d logits = one-hot(target) - softmax; times the token's incoming gradient
                grad_logits = logits.sub_(lse[rows].unsqueeze(1)).exp_().mul_(-scale[rows].unsqueeze(1))
                grad_logits.scatter_add_(1, index[rows].unsqueeze(1), scale[rows].unsqueeze(1))
                add_chunk_gradients(grad_logits.to(dtype), h, w, rows, (grad_hidden, grad_weight, grad_bias))
                del logits, grad_logits  # (one chunk's logits alive at a time)
        grads = (grad_hidden, grad_weight, grad_bias)
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        cast = tuple(None if g is None else g.to(d) for g, d in zip(grads, dtypes, strict=True))
        return (*cast, None, None, None)


def fused_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    with_squares: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(`hidden @ weight.T + bias`)[target] per token (fp32; 0 where the target is -100), and with
    `with_squares` each token's log Σ_v p(v)² without gradient (WPO's weights; else None)), shaped like `targets`.
    hidden: [..., hidden]; targets: hidden's leading shape."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    flat, squares = _FusedTokenLogProbs.apply(flat_hidden, weight, bias, flat_targets, chunk_bytes, with_squares)
    return flat.view(targets.shape), squares.view(targets.shape) if with_squares else None
