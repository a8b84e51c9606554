"""`Engine.objective_step`'s micro-step: an objective over whole sequences (preference training), in any layout.

The objective asks the `LayoutScorer` for per-sequence completion log-probabilities; the scorer runs the model in
the run's layout: the sequence split over context-parallel ranks (each rank's sums are added over the cp group,
differentiably, so every cp rank holds the whole sequences' values), the head's logits vocab-parallel under tensor
parallel (log-probabilities from `loss_parallel`, never gathering the logits), parameters sharded by ZeRO-3 and
gathered by FSDP for each forward. Under pipeline parallel a forward without a graph runs the schedule forward
only and the last stage's scores are broadcast; the training step runs the objective's loss on the last stage
(`meshkit.engine.pipelined_objective`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from meshkit.engine.context import EngineContext
from meshkit.engine.gradients import GradientSync
from meshkit.engine.head_sums import head_sums, pipelined_head_step
from meshkit.engine.pipelined_objective import pipeline_scores, pipelined_objective_step
from meshkit.engine.preparation import scoring_head
from meshkit.engine.prepared_objects import EngineError
from meshkit.engine.sequence_scores import row_scores, scoring_targets
from meshkit.parallel.fsdp import reshard
from meshkit.runtime import collectives
from meshkit.training.fused_head import FusedHead
from meshkit.training.loss import logits_of
from meshkit.training.objective import HeadObjective, Objective, ObjectiveResult, SequenceScores


class LayoutScorer:
    """Per-sequence summed completion log-probabilities of the prepared model (or another module laid out the same
    way), in the run's layout."""

    def __init__(self, ctx: EngineContext, forward_only: bool = False) -> None:
        self.ctx = ctx
        self.forward_only = forward_only  # every score without a graph (evaluation)

    def __call__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        model: nn.Module | None = None,
        context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        grad: bool = True,
        whole_mask: torch.Tensor | None = None,
        weighting: bool = False,
    ) -> SequenceScores:
        ctx = self.ctx
        grad = grad and not self.forward_only
        device = ctx.mesh.device
        if ctx.objects.pipeline is not None and model is None:
            if grad:
                raise EngineError("under pipeline parallel the policy's scores exist on the last stage only")
            with context() if context is not None else contextlib.nullcontext():
                return pipeline_scores(ctx, input_ids.to(device), labels.to(device), whole_mask, weighting)
        module = model if model is not None else ctx.objects.only_model()
        inputs, targets, completion = scoring_targets(input_ids.to(device), labels.to(device), whole_mask)
        if ctx.mesh.size("cp") > 1:
            inputs, targets, completion = ctx.shard_sequence((inputs, targets, completion))
        with contextlib.ExitStack() as stack:
            if not grad:
                stack.enter_context(torch.no_grad())
            if context is not None:
                stack.enter_context(context())
            fused = self._fused_head(model)
            with ctx.loss_parallel():
                with fused.log_probs_of(targets, weighting) if fused is not None else contextlib.nullcontext():
                    logits = logits_of(module(**{**ctx.objects.training_inputs, **inputs}))
                per_token = fused.take_log_probs(logits) if fused is not None else None
                if model is None and grad:
                    self._record(fused, per_token is not None)
                whole = whole_mask is not None
                scores = row_scores(ctx, logits, targets, completion, whole, grad, weighting, per_token)
        if not grad and ctx.placement.zero_stage == 3:
            reshard(module)  # (a forward without backward leaves FSDP's gathered parameters in place)
        return scores

    def _fused_head(self, model: nn.Module | None) -> FusedHead | None:
        """The head that gives each token's log-prob without the logits: the policy's (`model` None) or a frozen
        model's (a reference), computed the same way as the policy's."""
        objects = self.ctx.objects
        if objects.fused_head is None:
            return None
        if model is None:
            return objects.fused_head
        if model not in objects.frozen_heads:  # (a model the engine never prepared: learnt once)
            objects.frozen_heads[model] = scoring_head(model, self.ctx.config)
        return objects.frozen_heads[model]

    def _record(self, fused: FusedHead | None, ran_fused: bool) -> None:
        """The policy's scoring path into the run's record (`loss`), as it ran."""
        objects = self.ctx.objects
        if fused is not None and ran_fused:
            objects.loss_path = f"fused per-token log-probs ({fused.describe()})"
        elif fused is not None:
            objects.loss_path = "plain (whole logits): the head is split over its vocabulary (tensor parallel)"
        elif objects.loss_path and objects.loss_path.startswith("fused"):
            objects.loss_path = "plain (whole logits)"

    def head_sums(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        terms: int,
        grad: bool = True,
    ) -> torch.Tensor:
        return head_sums(self.ctx, input_ids, targets, values, terms, grad and not self.forward_only)


def objective_micro_step(
    ctx: EngineContext, objective: Objective, batch: Any, gradients: GradientSync
) -> ObjectiveResult:
    """One micro-step: the objective's loss, backward weighted by its example count over every rank; returns
    the result with `loss` the mean over every rank's examples of this micro-step."""
    if ctx.objects.pipeline is not None:  # (the record: these read the last stage's whole logits)
        ctx.objects.loss_path = "plain (whole logits): a pipeline's objective reads its last stage's logits"
    if ctx.objects.pipeline is not None and objective.reads_head:
        head = cast(HeadObjective, objective)  # (`reads_head`: the objective is a head objective)
        return pipelined_head_step(ctx, head, batch, gradients, LayoutScorer(ctx))
    if ctx.objects.pipeline is not None:
        return pipelined_objective_step(ctx, objective, batch, gradients, LayoutScorer(ctx))
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
