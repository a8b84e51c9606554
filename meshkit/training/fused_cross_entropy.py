"""Cross-entropy straight from the last hidden states and the head weight, a chunk of tokens at a time: the
[tokens, vocab] logits never exist whole, in the forward or the backward (what Cut Cross-Entropy and Liger's fused
linear cross-entropy do with GPU kernels; here in plain torch, so on every device).

Each chunk's logits are computed, turned into its losses and — when gradients are wanted — straight into its
share of the gradients of the hidden states, the weight and the bias (softmax minus the one-hot target, times the
token's weight), then dropped. The backward only scales those by the incoming gradient: the same three matrix
products a plain head's forward and backward run, in the same precision (the autocast dtype where autocast is on).

Vocab-parallel (`group`): each rank holds rows `vocab_start ...` of the weight; every chunk's row maxima,
exponent sums and target logits are reduced over the group, so each rank's softmax is its slice of the whole
one, its weight gradient its own rows', and the hidden states' gradient is summed over the group once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshkit.training.loss import IGNORE_INDEX, TokenWeights

CHUNK_BYTES = 64 * 2**20  # fp32 logits held at once per chunk (turned into their softmax and gradient in place)


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocab-parallel head: `group` holds the other rows, starting at `start`."""

    group: dist.ProcessGroup
    start: int


def chunk_tokens(vocab_rows: int, hidden: int, tokens: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within `chunk_bytes`, but never fewer than the
    hidden size. Each chunk adds its part to the whole [vocab, hidden] weight gradient: a pass over it that costs
    as much as `hidden` tokens' passes over their logits, so chunks of at least `hidden` tokens keep that pass a
    small share of the work (on an H200, 130-token chunks at a 128k vocabulary took 3.7× the plain loss's time,
    1046-token ones 1.4×)."""
    return max(1, min(tokens, max(chunk_bytes // (4 * max(vocab_rows, 1)), hidden)))


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the head's matrix product runs in: autocast's where it is on, else the hidden states'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [tokens, hidden]
        weight: torch.Tensor,  # [vocab rows, hidden]
        bias: torch.Tensor | None,  # [vocab rows]
        targets: torch.Tensor,  # [tokens]
        token_weights: TokenWeights | None,
        shard: VocabShard | None,
        chunk_bytes: int,
        grad_enabled: bool,
    ) -> torch.Tensor:
        dtype = compute_dtype(hidden.device, hidden.dtype)
        want_hidden, want_weight = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        want_bias = bias is not None and grad_enabled and ctx.needs_input_grad[2]
        want_any = want_hidden or want_weight or want_bias
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if want_hidden else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and want_bias else None
            total = torch.zeros((), device=hidden.device, dtype=torch.float32)
            step = chunk_tokens(weight.shape[0], hidden.shape[1], hidden.shape[0], chunk_bytes)
            for begin in range(0, hidden.shape[0], step):
                rows = slice(begin, begin + step)
                logits = F.linear(h[rows], w, b).float()  # [chunk, vocab rows]; becomes its gradient in place
                losses, grad_logits = _chunk_losses(logits, targets[rows], token_weights, shard, want_any)
                del logits  # (one chunk's logits alive at a time: the next chunk's take their place)
                total += losses.sum()
                if grad_logits is not None:
                    add_chunk_gradients(grad_logits.to(dtype), h, w, rows, (grad_hidden, grad_weight, grad_bias))
                del grad_logits
            if grad_hidden is not None and shard is not None:
                dist.all_reduce(grad_hidden, group=shard.group)  # each rank's vocab rows gave a part
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = tuple(
            None if grad is None else (grad * grad_total).to(dtype)
            for grad, dtype in zip(ctx.grads, ctx.dtypes, strict=True)
        )
        # (ctx keeps them: zero-bubble schedules run this backward twice, for the input then for the weights)
        return (*grads, None, None, None, None, None)


def add_chunk_gradients(
    grad_logits: torch.Tensor,  # [chunk, vocab rows], in the compute dtype
    h: torch.Tensor,  # [tokens, hidden]
    w: torch.Tensor,  # [vocab rows, hidden]
    rows: slice,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """One chunk's share of the fp32 gradients of the hidden states (its rows), the weight and the bias, from the
    gradient of its logits: the two products a plain head's backward runs, the weight's added in place."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        grad_hidden[rows] = grad_logits @ w
    if grad_weight is not None and grad_logits.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.t(), h[rows])  # in place: no product the size of the weight
    elif grad_weight is not None:
        grad_weight += grad_logits.t() @ h[rows]
    if grad_bias is not None:
        grad_bias += grad_logits.float().sum(0)


def _chunk_losses(
    logits: torch.Tensor,
    targets: torch.Tensor,
    token_weights: TokenWeights | None,
    shard: VocabShard | None,
    want_gradient: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's (weighted) loss over one chunk of fp32 logits [chunk, vocab rows], and the gradient of their
    sum with respect to the logits (None where no gradient is wanted)."""
    counted = targets != IGNORE_INDEX
    local_targets = targets if shard is None else targets - shard.start
    owned = counted & (local_targets >= 0) & (local_targets < logits.shape[1])
    index = torch.where(owned, local_targets, 0).unsqueeze(1)
    target_logits = logits.gather(1, index).squeeze(1) * owned
    row_max = logits.detach().amax(dim=1)
    if shard is not None:
        dist.all_reduce(row_max, dist.ReduceOp.MAX, group=shard.group)
    # in place where nothing reads the logits again (per-token weights do): one chunk-sized buffer, not three
    shifted = logits.sub_(row_max.unsqueeze(1)) if token_weights is None else logits - row_max.unsqueeze(1)
    probabilities = shifted.exp_()
    sums = probabilities.sum(dim=1)
    if shard is not None:
        reduced = torch.stack((sums, target_logits))
        dist.all_reduce(reduced, group=shard.group)
        sums, target_logits = reduced[0], reduced[1]
    scale = counted.float()
    if token_weights is not None:
        with torch.no_grad():
            scale = scale * token_weights(logits, targets)  # (logits left whole for them above)
    losses = (torch.log(sums) + row_max - target_logits) * scale
    if not want_gradient:
        return losses, None
    probabilities /= sums.unsqueeze(1)  # softmax, in place: its own buffer
    rows = torch.arange(logits.shape[0], device=logits.device)
    probabilities[rows, index.squeeze(1)] -= owned.float()
    return losses, probabilities.mul_(scale.unsqueeze(1))


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    token_weights: TokenWeights | None = None,
    shard: VocabShard | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """Summed cross-entropy (fp32) of `hidden @ weight.T + bias` against `targets` (-100: not counted), each
    token's times its weight where `token_weights` gives them (computed without gradient from its chunk's fp32
    logits; not under vocab parallel). hidden: [..., hidden]; targets: hidden's leading shape."""
    if token_weights is not None and shard is not None:
        raise ValueError("per-token loss weights need the whole vocabulary's logits: not under a vocab-parallel head")
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    return _FusedLinearCrossEntropy.apply(
        flat_hidden, weight, bias, flat_targets, token_weights, shard, chunk_bytes, torch.is_grad_enabled()
    )
