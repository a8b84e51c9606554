"""Per-sequence log-probabilities from a model's logits, in the run's layout: what every objective over whole
sequences reads (`meshkit.engine.objective_step`, `meshkit.engine.pipelined_objective`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.nn.functional as distributed_autograd
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshkit.engine.context import EngineContext
from meshkit.runtime import collectives
from meshkit.training.loss import IGNORE_INDEX, split_causal_lm_batch
from meshkit.training.objective import SequenceScores


def scoring_targets(
    input_ids: torch.Tensor, labels: torch.Tensor, whole_mask: torch.Tensor | None
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(model inputs, next-token targets, which targets are the completion's): the targets are every real token's
    when `whole_mask` asks for them, else the completion's."""
    inputs, targets = split_causal_lm_batch({"input_ids": input_ids, "labels": labels})
    completion = targets != IGNORE_INDEX
    if whole_mask is not None:
        whole_labels = input_ids.masked_fill(whole_mask.to(input_ids.device) == 0, IGNORE_INDEX)
        targets = split_causal_lm_batch({"input_ids": input_ids, "labels": whole_labels})[1]
    return inputs, targets, completion


def row_scores(
    ctx: EngineContext,
    logits: torch.Tensor,
    targets: torch.Tensor,
    completion: torch.Tensor,
    whole: bool,
    grad: bool,
    weighting: bool = False,
    fused: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> SequenceScores:
    """Per row: the completion's summed log-probs and count (and every real token's, with `whole`; WPO's weight
    with `weighting`), summed over the context-parallel ranks (differentiably when `grad`). Runs inside
    `loss_parallel` under tp. `fused`: each token's log-prob (and with `weighting` its log Σ p²) computed without
    the logits by the fused head, [rows, seq]; `logits` are then not read."""
    rows = targets.shape[0]
    per_token, squares = fused if fused is not None else (None, None)
    if per_token is None:
        per_token = -F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        if isinstance(per_token, DTensor):
            per_token = per_token.full_tensor()
    per_token = per_token.view(rows, -1)  # [rows, seq]; ignored targets count 0
    sums = [per_token.masked_fill(~completion, 0).sum(-1)]
    counts = [completion.sum(-1).float()]
    if whole:
        sums.append(per_token.sum(-1))
        counts.append((targets != IGNORE_INDEX).sum(-1).float())
    logps, tokens = torch.stack(sums), torch.stack(counts)
    aligned = _aligned_sums(logits, per_token, completion, squares) if weighting else None
    if ctx.mesh.size("cp") > 1:  # each cp rank holds two chunks of every row: the whole rows' sums on every cp rank
        group = ctx.mesh.group("cp")
        logps = distributed_autograd.all_reduce(logps, group=group) if grad else collectives.reduce(logps, group, "sum")
        tokens = collectives.reduce(tokens, group, op="sum")
        aligned = None if aligned is None else collectives.reduce(aligned, group, op="sum")
    log_weights = None if aligned is None else aligned / tokens[0].clamp(min=1)
    if not whole:
        return SequenceScores(logps[0], tokens[0], log_weights=log_weights)
    return SequenceScores(logps[0], tokens[0], logps[1], tokens[1], log_weights)


@torch.no_grad()
def _aligned_sums(
    logits: torch.Tensor, per_token: torch.Tensor, completion: torch.Tensor, squares: torch.Tensor | None = None
) -> torch.Tensor:
    """Per row, WPO's sum over completion tokens of log p(token) − log Σ_v p(v)² (TRL's `log_sum_sq_probs`), where
    log Σ_v p(v)² = logsumexp(2z) − 2·logsumexp(z) over the vocabulary — split over tp when the head is; `squares`:
    already computed per token (the fused head), the logits not read."""
    rows = per_token.shape[0]
    if squares is not None:
        return (per_token.detach() - squares.reshape(rows, -1)).masked_fill(~completion, 0).sum(-1)
    vocab = logits.ndim - 1
    if isinstance(logits, DTensor) and not any(p.is_shard(vocab) for p in logits.placements):
        logits = logits.full_tensor()
    if isinstance(logits, DTensor):  # vocab-parallel: each tp rank holds a slice of every token's logits
        local = logits.to_local().float()
        dim = next(i for i, p in enumerate(logits.placements) if p.is_shard(vocab))
        group = logits.device_mesh.get_group(dim)
        squares = _logsumexp_over(2 * local, group) - 2 * _logsumexp_over(local, group)
    else:
        local = logits.float()
        squares = torch.logsumexp(2 * local, dim=-1) - 2 * torch.logsumexp(local, dim=-1)
    aligned = (per_token.detach() - squares.reshape(rows, -1)).masked_fill(~completion, 0)
    return aligned.sum(-1)


def _logsumexp_over(local: torch.Tensor, group: Any) -> torch.Tensor:
    """logsumexp over the last dimension, split over `group`'s ranks."""
    largest = collectives.reduce(local.amax(dim=-1), group, op="max")
    summed = collectives.reduce(torch.exp(local - largest.unsqueeze(-1)).sum(-1), group, op="sum")
    return summed.log() + largest
