"""`Engine.objective_step`'s micro-step: an objective over whole sequences (preference training), in any layout.

The objective asks the `LayoutScorer` for per-sequence completion log-probabilities; the scorer runs the model in
the run's layout: the sequence split over context-parallel ranks (each rank's sums are added over the cp group,
differentiably, so every cp rank holds the whole sequences' values), the head's logits vocab-parallel under tensor
parallel (log-probabilities from `loss_parallel`, never gathering the logits), parameters sharded by ZeRO-3 and
gathered by FSDP for each forward. Pipelines run the token loss only: their schedule owns the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.nn.functional as distributed_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.engine.context import EngineContext
from meshkit.engine.gradients import GradientSync
from meshkit.engine.prepared import EngineError
from meshkit.parallel.fsdp import reshard
from meshkit.runtime import collectives
from meshkit.training.loss import IGNORE_INDEX, logits_of, split_causal_lm_batch
from meshkit.training.objective import Objective, ObjectiveResult, SequenceScores


class LayoutScorer:
    """Per-sequence summed completion log-probabilities of the prepared model (or another module laid out the same
    way), in the run's layout."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def __call__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        model: nn.Module | None = None,
        context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        grad: bool = True,
        whole_mask: torch.Tensor | None = None,
    ) -> SequenceScores:
        ctx = self.ctx
        module = model if model is not None else ctx.objects.only_model()
        device = ctx.mesh.device
        input_ids, labels = input_ids.to(device), labels.to(device)
        inputs, targets = split_causal_lm_batch({"input_ids": input_ids, "labels": labels})
        completion = targets != IGNORE_INDEX
        if whole_mask is not None:  # every real token's target; the completion's are among them
            targets = split_causal_lm_batch(
                {"input_ids": input_ids, "labels": input_ids.masked_fill(whole_mask.to(device) == 0, IGNORE_INDEX)}
            )[1]  # noqa: E501
        rows = targets.shape[0]
        cp = ctx.mesh.size("cp")
        if cp > 1:
            inputs, targets, completion = ctx.shard_sequence((inputs, targets, completion))
        with contextlib.ExitStack() as stack:
            if not grad:
                stack.enter_context(torch.no_grad())
            if context is not None:
                stack.enter_context(context())
            with ctx.loss_parallel():
                logits = logits_of(module(**{**ctx.objects.training_inputs, **inputs}))
                per_token = -F.cross_entropy(
                    logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
                )
            if isinstance(per_token, DTensor):
                per_token = per_token.full_tensor()
            per_token = per_token.view(rows, -1)  # [rows, seq]; ignored targets count 0
            sums = [per_token.masked_fill(~completion, 0).sum(-1)]
            counts = [completion.sum(-1).float()]
            if whole_mask is not None:
                sums.append(per_token.sum(-1))
                counts.append((targets != IGNORE_INDEX).sum(-1).float())
            logps, tokens = torch.stack(sums), torch.stack(counts)
            if cp > 1:  # each cp rank holds two chunks of every row: the whole rows' sums on every cp rank
                group = ctx.mesh.group("cp")
                logps = (
                    distributed_autograd.all_reduce(logps, group=group)
                    if grad
                    else collectives.reduce(logps, group, op="sum")
                )
                tokens = collectives.reduce(tokens, group, op="sum")
        if not grad and ctx.placement.zero_stage == 3:
            reshard(module)  # (a forward without backward leaves FSDP's gathered parameters in place)
        if whole_mask is None:
            return SequenceScores(logps[0], tokens[0])
        return SequenceScores(logps[0], tokens[0], logps[1], tokens[1])


def objective_micro_step(
    ctx: EngineContext, objective: Objective, batch: Any, gradients: GradientSync
) -> ObjectiveResult:
    """One micro-step: the objective's loss, backward weighted by its example count over every rank; returns
    the result with `loss` the mean over every rank's examples of this micro-step."""
    if ctx.objects.pipeline is not None:
        raise EngineError(
            "an objective over whole sequences (preference training) does not run under pipeline parallel yet: set "
            "pp=1 (dp, ZeRO, tp and cp all run it)"
        )
    result = objective(LayoutScorer(ctx), batch)
    loss = result.loss
    # the loss sum and example count over every rank, summed while backward runs
    summed = collectives.start_sum(
        torch.stack((loss.detach().float() * result.items, torch.tensor(float(result.items), device=loss.device))),
        ctx.placement.grad_group,
    )
    gradients.backward(loss, result.items, global_items=lambda: float(summed()[1]))
    total = summed()
    return ObjectiveResult(total[0] / total[1].clamp(min=1), result.items, result.metrics)
