"""Objectives over whole sequences under pipeline parallel: the schedule owns the forward, so the objective's loss
runs on the last stage, one micro-batch at a time.

- Scores without a graph (a reference, KTO's KL rows, evaluation): the schedule runs forward only with a loss that
  keeps each micro-batch's per-row scores; the last stage broadcasts them to every stage (`pipeline_scores`).
- The training step: the objective's `references` first (forward-only passes), then one schedule step whose loss,
  on the last stage, scores the micro-batch's rows and hands them with their per-row extras to the objective's
  `loss_of`. A pair's chosen and rejected rows are put in the same micro-batch. Each micro-batch's loss is weighted
  so the step's gradient is the mean over every example of every data-parallel rank, as without a pipeline.

Targets travel to the last stage as one float64 tensor per row: the next-token targets (every real token's, when the
objective reads whole rows), which of them are the completion's, then the per-row extras.
"""

from __future__ import annotations

from typing import Any

import torch

from meshkit.engine.context import EngineContext
from meshkit.engine.gradients import GradientSync
from meshkit.engine.pipeline_passes import scored_rows, weighted_step
from meshkit.engine.prepared_objects import EngineError
from meshkit.engine.sequence_scores import row_scores, scoring_targets
from meshkit.training.loss import logits_of
from meshkit.training.objective import Objective, ObjectiveResult, Scorer, SequenceScores


def _packed(targets: torch.Tensor, completion: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows, 2 × seq + extras] float64: targets, completion flags, then one column per extra."""
    columns = [targets.double(), completion.double()]
    columns += [extras[name].to(targets.device).double().reshape(-1, 1) for name in sorted(extras)]
    return torch.cat(columns, dim=1)


def _unpacked(target: torch.Tensor, width: int, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    targets = target[:, :width].long()
    completion = target[:, width : 2 * width].bool()
    extras = {name: target[:, 2 * width + i] for i, name in enumerate(names)}
    return targets, completion, extras


def _split_for_pipeline(ctx: EngineContext, input_ids: torch.Tensor, labels: torch.Tensor, whole: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip  # noqa: E501
    inputs, targets, completion = scoring_targets(input_ids, labels, whole)
    if ctx.mesh.size("cp") > 1:
        inputs, targets, completion = ctx.shard_sequence((inputs, targets, completion))
    extra = sorted(set(inputs) - {"input_ids"})
    if extra:
        raise EngineError(f"under pipeline parallel a stage takes only input_ids: drop {extra} from the batch")
    return inputs["input_ids"], targets, completion


def pipeline_scores(
    ctx: EngineContext,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    whole_mask: torch.Tensor | None,
    weighting: bool = False,
) -> SequenceScores:
    """Per-row scores of a forward-only schedule pass, on every pipeline stage."""
    runner = ctx.objects.pipeline
    assert runner is not None
    first, targets, completion = _split_for_pipeline(ctx, input_ids, labels, whole_mask)
    width, whole = targets.shape[1], whole_mask is not None

    def score(output: Any, target: torch.Tensor) -> torch.Tensor:
        part_targets, part_completion, _ = _unpacked(target, width, [])
        scores = row_scores(ctx, logits_of(output), part_targets, part_completion, whole, False, weighting)
        columns = [scores.logps, scores.tokens]
        if whole:
            assert scores.whole_logps is not None and scores.whole_tokens is not None
            columns += [scores.whole_logps, scores.whole_tokens]
        if weighting:
            assert scores.log_weights is not None
            columns.append(scores.log_weights)
        return torch.stack(columns, dim=1)

    shape = (input_ids.shape[0], (4 if whole else 2) + int(weighting))
    packed = _packed(targets, completion, {})
    found = scored_rows(ctx, first, packed, score, shape, ctx.loss_parallel())
    log_weights = found[:, -1] if weighting else None
    if not whole:
        return SequenceScores(found[:, 0], found[:, 1], log_weights=log_weights)
    return SequenceScores(found[:, 0], found[:, 1], found[:, 2], found[:, 3], log_weights)


def pair_order(rows: int, microbatches: int) -> torch.Tensor:
    """Row order putting each micro-batch's pairs' chosen rows, then their rejected rows, together."""
    pairs = rows // 2
    if pairs % microbatches:
        raise EngineError(
            f"{pairs} pairs per rank do not split into pipeline.microbatches={microbatches} with each pair whole: "
            "make micro_batch_size a multiple of it"
        )
    per = pairs // microbatches
    order = []
    for k in range(microbatches):
        chunk = list(range(k * per, (k + 1) * per))
        order += chunk + [pairs + i for i in chunk]
    return torch.tensor(order)


def pipelined_objective_step(
    ctx: EngineContext, objective: Objective, batch: Any, gradients: GradientSync, scorer: Scorer
) -> ObjectiveResult:
    """`scorer`: the layout's scorer, whose forward-only scores (the objective's references) come from
    `pipeline_scores`."""
    runner = ctx.objects.pipeline
    assert runner is not None
    device = ctx.mesh.device
    extras = objective.references(scorer, batch)
    input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    rows = input_ids.shape[0]
    order = pair_order(rows, runner.microbatches) if objective.pairs_together else torch.arange(rows)
    order = order.to(device)
    whole_mask = batch["attention_mask"].to(device)[order] if objective.needs_whole else None
    first, targets, completion = _split_for_pipeline(ctx, input_ids[order], labels[order], whole_mask)
    names = sorted(extras)
    packed = _packed(targets, completion, {name: extras[name].to(device)[order] for name in names})
    width = targets.shape[1]
    items = extras["valid"].sum() // (2 if objective.pairs_together else 1)

    def part_loss(output: Any, target: torch.Tensor) -> ObjectiveResult:
        part_targets, part_completion, part_extras = _unpacked(target, width, names)
        part_extras = {
            name: value.bool() if name in ("valid", "desirable") else value for name, value in part_extras.items()
        }
        scores = row_scores(
            ctx,
            logits_of(output),
            part_targets,
            part_completion,
            objective.needs_whole,
            True,
            objective.needs_weighting,
        )
        return objective.loss_of(scores, part_extras)

    return weighted_step(ctx, first, packed, part_loss, items, gradients, ctx.loss_parallel())
