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
    ctx: EngineContext, logits: torch.Tensor, targets: torch.Tensor, completion: torch.Tensor, whole: bool, grad: bool
) -> SequenceScores:
    """Per row: the completion's summed log-probs and count (and every real token's, with `whole`), summed over
    the context-parallel ranks (differentiably when `grad`). Runs inside `loss_parallel` under tp."""
    rows = targets.shape[0]
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
    if ctx.mesh.size("cp") > 1:  # each cp rank holds two chunks of every row: the whole rows' sums on every cp rank
        group = ctx.mesh.group("cp")
        logps = distributed_autograd.all_reduce(logps, group=group) if grad else collectives.reduce(logps, group, "sum")
        tokens = collectives.reduce(tokens, group, op="sum")
    if not whole:
        return SequenceScores(logps[0], tokens[0])
    return SequenceScores(logps[0], tokens[0], logps[1], tokens[1])
