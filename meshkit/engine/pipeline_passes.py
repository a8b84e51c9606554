"""The two ways an objective runs through a pipeline schedule, written once for every objective (sequence scores,
a classification head's sums): the schedule owns the forward, so the objective's loss is swapped into the last
stage and runs there one micro-batch at a time.

- `scored_rows`: forward only; the swapped loss keeps each micro-batch's per-row values, and the last stage
  broadcasts them to every stage.
- `weighted_step`: one training step; each micro-batch's loss is weighted so the step's gradient is the mean over
  every example of every data-parallel rank, as without a pipeline, and the step's loss and metric sums are known
  on every stage.

torch's schedule may call the loss more than once for a micro-batch (its first, to settle shapes): only the calls
whose result it kept count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshkit.engine.context import EngineContext
from meshkit.engine.gradients import GradientSync
from meshkit.runtime import collectives
from meshkit.training.objective import ObjectiveResult

RowValues = Callable[[Any, torch.Tensor], torch.Tensor]  # (stage output, packed targets) -> [rows, columns]
PartLoss = Callable[[Any, torch.Tensor], ObjectiveResult]  # (stage output, packed targets) -> the part's result


def broadcast_from_last(ctx: EngineContext, tensor: torch.Tensor) -> torch.Tensor:
    runner = ctx.objects.pipeline
    assert runner is not None
    dist.broadcast(tensor, src=runner.last_stage_rank, group=runner.group)
    return tensor


def scored_rows(
    ctx: EngineContext,
    first: torch.Tensor,
    packed: torch.Tensor,
    values: RowValues,
    shape: tuple[int, int],
    around: contextlib.AbstractContextManager[Any] | None = None,
) -> torch.Tensor:
    """[rows, columns] of `values` per micro-batch of a forward-only pass, on every stage (`shape` where this
    stage computes none)."""
    runner = ctx.objects.pipeline
    assert runner is not None
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(output: Any, target: torch.Tensor) -> torch.Tensor:
        marker = torch.zeros((), device=target.device)
        kept.append((marker, values(output, target).float()))
        return marker

    with torch.no_grad(), runner.swapped_loss(keep), around or contextlib.nullcontext():
        used = {id(loss) for loss in runner.run(first, packed, forward_only=True)}
    parts = [rows for marker, rows in kept if id(marker) in used]  # (once per micro-batch, in order)
    found = torch.cat(parts) if parts else torch.zeros(shape, device=first.device)
    return broadcast_from_last(ctx, found.contiguous())


def weighted_step(
    ctx: EngineContext,
    first: torch.Tensor,
    packed: torch.Tensor,
    part_loss: PartLoss,
    items: torch.Tensor,
    gradients: GradientSync,
    around: contextlib.AbstractContextManager[Any] | None = None,
) -> ObjectiveResult:
    """One schedule step whose loss is `part_loss` per micro-batch, weighted by its examples over every rank's
    (`items`: this rank's examples)."""
    runner = ctx.objects.pipeline
    assert runner is not None
    device = ctx.mesh.device
    group = ctx.placement.grad_group
    global_items = float(collectives.reduce(items.float().to(device), group, op="sum"))
    weight = runner.microbatches * collectives.group_size(group) / max(global_items, 1.0)
    results: list[tuple[torch.Tensor, ObjectiveResult]] = []

    def weighted_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        result = part_loss(output, target)
        weighted = result.loss * result.items * weight  # (the schedule divides by the micro-batches)
        results.append((weighted, result))
        return weighted

    with runner.swapped_loss(weighted_loss), around or contextlib.nullcontext():
        used = runner.run(first, packed, forward_only=False)
    gradients.reduce_after_schedule()
    kept = {id(loss) for loss in used}
    counted = [result for loss, result in results if id(loss) in kept]
    return _gathered_result(ctx, counted, group, global_items, int(items))


def _gathered_result(
    ctx: EngineContext, results: list[ObjectiveResult], group: Any, global_items: float, items: int
) -> ObjectiveResult:
    """The step's loss (mean over every rank's examples) and this rank's metric sums, known on every stage."""
    runner = ctx.objects.pipeline
    assert runner is not None
    device = ctx.mesh.device
    total = sum((r.loss.detach().float() * r.items for r in results), torch.zeros((), device=device))
    metrics: dict[str, list[float]] = {}
    for result in results:
        for name, (value, count) in result.metrics.items():
            pair = metrics.setdefault(name, [0.0, 0.0])
            pair[0] += float(value)
            pair[1] += float(count)
    shared: list[Any] = [(float(total), metrics)]
    dist.broadcast_object_list(shared, src=runner.last_stage_rank, group=runner.group)
    loss_sum, metric_sums = shared[0]
    loss = collectives.reduce(torch.tensor(loss_sum, device=device), group, op="sum") / max(global_items, 1.0)
    sums = {
        name: (torch.tensor(v, device=device), torch.tensor(c, device=device)) for name, (v, c) in metric_sums.items()
    }
    return ObjectiveResult(loss, items, sums)
