"""Objectives over a classification head's per-token outputs (reward and process reward models), in any layout.

A reward model's forward pools its head's scores at each row's last token; a process reward model's head scores
every token. Either way the objective reads per-token terms of the head's outputs and the row's per-token targets
(`HeadObjective.token_values`: the score at the pooled position, the cross-entropy of each labelled step) summed
over each row — sums that split over the sequence like the log-probabilities of preference training: each context-
parallel rank sums its own chunks and the sums are added over the cp group (differentiably for a training step);
under tensor parallel the head is replicated (the structure layer names it) so its outputs are whole; under
pipeline parallel the last stage hands the head's outputs to the objective's loss, one micro-batch at a time.
The head's outputs are taken from the head module itself (a forward hook), before the model pools them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.nn.functional as distributed_autograd
from torch import nn

from meshkit.engine.context import EngineContext
from meshkit.engine.gradients import GradientSync
from meshkit.engine.pipeline_passes import scored_rows, weighted_step
from meshkit.engine.pipelined_objective import pair_order
from meshkit.engine.prepared_objects import EngineError
from meshkit.parallel.compose import unwrap
from meshkit.parallel.fsdp import reshard
from meshkit.runtime import collectives
from meshkit.training.loss import logits_of
from meshkit.training.objective import HeadObjective, ObjectiveResult, Scorer

TokenValues = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def tapped(module: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """`{"outputs": ...}` holds what `module` returned in its last forward inside the block."""
    seen: dict[str, torch.Tensor] = {}

    def keep(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        seen["outputs"] = output

    handle = module.register_forward_hook(keep)
    try:
        yield seen
    finally:
        handle.remove()


class _Joined(torch.autograd.Function):
    """`outputs` as they are, with the model's own (pooled) output joined to the graph: a zero gradient reaches it,
    so the hooks a sharded model set on its outputs (FSDP gathers the head's weights for backward there) run."""

    @staticmethod
    def forward(ctx: Any, outputs: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        ctx.pooled_shape, ctx.pooled_dtype = pooled.shape, pooled.dtype
        return outputs.view_as(outputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.zeros(ctx.pooled_shape, dtype=ctx.pooled_dtype, device=grad.device)


def summed(ctx: EngineContext, values: torch.Tensor, grad: bool) -> torch.Tensor:
    """[terms, rows, seq] per-token terms -> [terms, rows], whole rows on every context-parallel rank."""
    sums = values.sum(-1)
    if ctx.mesh.size("cp") > 1:
        group = ctx.mesh.group("cp")
        sums = distributed_autograd.all_reduce(sums, group=group) if grad else collectives.reduce(sums, group, "sum")
    return sums


def head_sums(
    ctx: EngineContext,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    values: TokenValues,
    terms: int,
    grad: bool,
) -> torch.Tensor:
    """[terms, rows]: the row sums of `values(head outputs, targets)` of the prepared model."""
    classifier = ctx.objects.classifier
    if classifier is None:
        raise EngineError("the prepared model has no classification head (a reward model's `score`) to read")
    device = ctx.mesh.device
    input_ids, targets = input_ids.to(device), targets.to(device)
    if ctx.objects.pipeline is not None:
        if grad:
            raise EngineError("under pipeline parallel the head's outputs exist on the last stage only")
        return _pipeline_head_sums(ctx, input_ids, targets, values, terms)
    module = ctx.objects.only_model()
    inputs = {"input_ids": input_ids}
    if ctx.mesh.size("cp") > 1:
        inputs, targets = ctx.shard_sequence((inputs, targets))
    with (
        contextlib.nullcontext() if grad else torch.no_grad(),
        tapped(unwrap(module).get_submodule(classifier)) as seen,
    ):
        pooled = logits_of(module(**{**ctx.objects.training_inputs, **inputs}))
        outputs = seen["outputs"] if pooled is seen["outputs"] else _Joined.apply(seen["outputs"], pooled)
        sums = summed(ctx, values(outputs, targets), grad)
    if not grad and ctx.placement.zero_stage == 3:
        reshard(module)  # (a forward without backward leaves FSDP's gathered parameters in place)
    return sums


def _pipeline_head_sums(
    ctx: EngineContext, input_ids: torch.Tensor, targets: torch.Tensor, values: TokenValues, terms: int
) -> torch.Tensor:
    """The row sums of a forward-only schedule pass, on every pipeline stage."""
    rows = input_ids.shape[0]
    if ctx.mesh.size("cp") > 1:
        input_ids, targets = ctx.shard_sequence((input_ids, targets))

    def row_sums(output: Any, target: torch.Tensor) -> torch.Tensor:
        return summed(ctx, values(output, target.long()), False).T

    return scored_rows(ctx, input_ids, targets.double(), row_sums, (rows, terms)).T


def pipelined_head_step(
    ctx: EngineContext, objective: HeadObjective, batch: Any, gradients: GradientSync, scorer: Scorer
) -> ObjectiveResult:
    """A training step of a head objective under pipeline parallel: the loss on the last stage per micro-batch,
    weighted so the step's gradient is the mean over every example of every data-parallel rank."""
    runner = ctx.objects.pipeline
    assert runner is not None
    device = ctx.mesh.device
    extras = objective.references(scorer, batch)
    input_ids, targets = batch["input_ids"].to(device), objective.head_targets(batch).to(device)
    rows = input_ids.shape[0]
    order = (pair_order(rows, runner.microbatches) if objective.pairs_together else torch.arange(rows)).to(device)
    input_ids, targets = input_ids[order], targets[order]
    names = sorted(extras)
    ordered = {name: extras[name].to(device)[order] for name in names}
    items = objective.count(targets, ordered)
    if ctx.mesh.size("cp") > 1:
        input_ids, targets = ctx.shard_sequence((input_ids, targets))
    width = targets.shape[1]
    packed = torch.cat([targets.double(), *(ordered[name].double().reshape(-1, 1) for name in names)], dim=1)

    def part_loss(output: Any, target: torch.Tensor) -> ObjectiveResult:
        part = {name: target[:, width + i].bool() if name == "valid" else target[:, width + i]
                for i, name in enumerate(names)}  # fmt: skip
        sums = summed(ctx, objective.token_values(output, target[:, :width].long()), True)
        return objective.loss_of_sums(sums, part)

    return weighted_step(ctx, input_ids, packed, part_loss, items, gradients)
