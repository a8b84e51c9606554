"""The causal-LM loss computed inside the head's own forward, from its input and weight, without the logits.

A head whose output the model returns unchanged as its logits (`models/own_loss.py` learns it) gets its forward
swapped: while `loss_of(targets)` is open, its next call computes the summed cross-entropy of its input against the
targets with `fused_linear_cross_entropy` and returns an empty stand-in for the logits ([..., 0]); every other call
(evaluation, generation, a reference forward) is the head's own. Computing inside the head's forward keeps every
layout's hooks in place: ZeRO-3 has the weight gathered there, tensor parallel hands it its input and its slice
of the vocabulary as DTensors (a vocab-sharded head reduces the softmax over tp), and the gradients flow back
through both as they would from the logits. The stand-in is a view of the loss, and the loss handed back is
taken through it: the backward passes the model's output, where ZeRO-3 gathers the weights again for it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshkit.training.fused_cross_entropy import CHUNK_BYTES, VocabShard, chunk_tokens, fused_linear_cross_entropy
from meshkit.training.fused_log_probs import fused_token_log_probs
from meshkit.training.loss import LossError, TokenWeights


class FusedHead:
    """Swaps `head`'s forward; `loss_of(targets)` around the model's forward, then `take_loss(logits)` (a pipeline's
    last stage opens it around each micro-batch's forward: the losses are taken in the order they were computed)."""

    def __init__(self, head: nn.Module, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.head = head
        self.chunk_bytes = chunk_bytes
        self._original = type(head).forward.__get__(head)  # (the module's own, also when prepared again)
        # (targets, token weights, what is wanted: "loss" summed, or per-token "log_probs" (+ "squares": WPO's))
        self._pending: tuple[torch.Tensor, TokenWeights | None, str] | None = None
        self._squares: deque[torch.Tensor | None] = deque()  # (beside each per-token result, in order)
        self._losses: deque[torch.Tensor] = deque()  # (computed, not yet taken: a pipeline's, in order)
        head.forward = self._forward  # (an instance attribute: hooks still run)

    def describe(self) -> str:
        """`chunks of 512 tokens over 131,072 vocab rows`: one chunk of the loss at the whole vocabulary (a rank
        holding 1/tp of the rows takes tp times the tokens per chunk)."""
        rows, hidden = cast(torch.Tensor, self.head.weight).shape  # (a DTensor's global shape)
        tokens = chunk_tokens(int(rows), int(hidden), 2**31, self.chunk_bytes)
        return f"chunks of {tokens:,} tokens over {int(rows):,} vocab rows"

    def remove(self) -> None:
        """The head's own forward again."""
        self.head.__dict__.pop("forward", None)

    @contextlib.contextmanager
    def loss_of(self, targets: torch.Tensor, weights: TokenWeights | None = None, fresh: bool = True) -> Iterator[None]:
        """The head's next call computes the loss against `targets` (shaped like its input without the last dim).
        `fresh`: a loss computed earlier and never taken (a step that failed half-way) is dropped first (a pipeline's
        micro-batches pass False: their losses are taken in turn)."""
        if fresh:
            self._losses.clear()
        self._pending = (targets, weights, "loss")
        try:
            yield
        finally:
            self._pending = None

    @contextlib.contextmanager
    def log_probs_of(self, targets: torch.Tensor, squares: bool = False) -> Iterator[None]:
        """The head's next call computes each token's log-probability of its target (0 where -100) without the
        logits (preference and reward objectives' per-sequence sums), and with `squares` each token's
        log Σ_v p(v)² (WPO's weights); `take_log_probs` hands them back."""
        self._losses.clear()
        self._squares.clear()
        self._pending = (targets, None, "squares" if squares else "log_probs")
        try:
            yield
        finally:
            self._pending = None

    def take_log_probs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(per-token log-probs, log Σ p² or None) of the call under `log_probs_of`, shaped like its targets, the
        log-probs through the model's output `logits` (their stand-in); None: the head ran as itself (the caller
        reads the logits)."""
        taken = self.take_loss(logits)
        return None if taken is None else (taken, self._squares.popleft())

    def forget(self) -> None:
        """Drop losses computed but not taken (a step that failed half-way)."""
        self._losses.clear()

    def take_loss(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The summed loss of the head's earliest call not yet taken, through the model's output `logits` (its
        stand-in); None: the head ran as itself, and the caller computes the loss from the logits."""
        if not self._losses:
            return None
        loss = self._losses.popleft()
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        if local.numel() != 0:
            raise LossError("the model changed its head's output on the way out (logits): set fused_loss=off")
        return loss + local.sum()  # (the empty stand-in adds nothing but its place in the graph)

    @torch.compiler.disable  # (a whole-model compile breaks its graph here rather than tracing the chunk loop)
    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._pending is None:
            return self._original(hidden)
        (targets, weights, wanted), self._pending = self._pending, None
        per_token = wanted != "loss"
        weight = cast(torch.Tensor, self.head.weight)
        bias: torch.Tensor | None = getattr(self.head, "bias", None)
        shard = _vocab_shard(weight)
        if (weights is not None or per_token) and shard is not None:  # (these read the whole vocabulary's logits)
            return self._original(hidden)
        local_hidden = _local(hidden)
        if per_token:
            log_probs, squares = fused_token_log_probs(
                local_hidden, _local(weight), targets, None if bias is None else _local(bias), self.chunk_bytes,
                with_squares=wanted == "squares",
            )  # fmt: skip
            self._losses.append(log_probs)
            self._squares.append(squares)
            return _stand_in(log_probs.unsqueeze(-1)[..., :0], weight)  # [..., 0]: a view of every token's value
        loss = fused_linear_cross_entropy(
            local_hidden, _local(weight), targets, None if bias is None else _local(bias), weights, shard,
            self.chunk_bytes,
        )  # fmt: skip
        self._losses.append(loss)
        return _stand_in(loss.expand(*local_hidden.shape[:-1], 0), weight)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor
    if all(isinstance(placement, Replicate) for placement in tensor.placements):
        return tensor.to_local()
    return tensor.full_tensor() if tensor.device_mesh.ndim != 1 else tensor.to_local()


def _vocab_shard(weight: torch.Tensor) -> VocabShard | None:
    """This rank's rows of a head weight split over its vocabulary (a 1-D mesh, Shard(0)); None when whole."""
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1:
        return None
    if not isinstance(weight.placements[0], Shard) or weight.placements[0].dim != 0:
        return None
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return VocabShard(weight.device_mesh.get_group(), int(offset[0]))


def _stand_in(empty: torch.Tensor, weight: torch.Tensor) -> Any:
    """`empty`, a [..., 0] view of what was computed, where the logits would be: a DTensor placed as the head's
    output when its weight is one (tensor parallel's output hook redistributes it)."""
    if not isinstance(weight, DTensor):
        return empty
    placements = [Shard(empty.dim() - 1) if isinstance(p, Shard) else Replicate() for p in weight.placements]
    return DTensor.from_local(empty, weight.device_mesh, placements, run_check=False)
