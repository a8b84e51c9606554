"""Running a pipeline step: torch's PipelineStage per model chunk, one schedule, the loss on every rank."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from meshkit.config.layout import check_pipeline
from meshkit.config.schema import PipelineConfig
from meshkit.parallel.pipeline.router_balance import PipelineBalancing
from meshkit.parallel.pipeline.stages import (
    SINGLE_STAGE,
    PipelineError,
    PipelineModel,
    forward_only_refusal,
    schedule_class,
    stage_ids,
)
from meshkit.runtime import collectives
from meshkit.runtime.mesh import ParallelMesh
from meshkit.training.loss import IGNORE_INDEX, CausalLMLoss


class _Stage(PipelineStage):
    """A stage whose forward of micro-batch `i` runs inside `around_forward(i)` when set (the fused loss's targets)."""

    around_forward: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        around = self.around_forward
        with around(fwd_chunk_id) if around is not None else contextlib.nullcontext():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)


class PipelineRunner:
    """Drives this rank's stages through the configured schedule; `step` returns the mean micro-batch loss."""

    def __init__(self, model: PipelineModel, mesh: ParallelMesh, cfg: PipelineConfig, loss_fn: Any) -> None:
        if loss_fn is None:
            raise PipelineError("pipeline parallel computes the loss on the last stage: pass loss_fn= to prepare()")
        pp = mesh.size("pp")
        self.model = model
        self.loss_fn = loss_fn
        self.schedule_name = cfg.schedule
        self.group = mesh.group("pp")
        self.microbatches = check_pipeline(cfg, pp)
        self.stages = [
            _Stage(chunk, index, model.stages, mesh.device, group=self.group)
            for chunk, index in zip(model.chunks, model.stage_list, strict=True)
        ]
        stage_arg = self.stages[0] if cfg.schedule in SINGLE_STAGE else self.stages
        # (the schedule calls `_loss`, so `swapped_loss` can run another loss for a step)
        self.schedule = schedule_class(cfg.schedule)(stage_arg, n_microbatches=self.microbatches, loss_fn=self._loss)
        owner = next(r for r in range(pp) if model.stages - 1 in stage_ids(r, pp, len(model.stage_list), cfg.schedule))
        self.last_stage_rank = dist.get_global_rank(self.group, owner)
        self.balancing: PipelineBalancing | None = None  # the router's balancing loss of an MoE model
        self.balancing_group: dist.ProcessGroup | None = None

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)

    @contextlib.contextmanager
    def swapped_loss(self, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> Iterator[None]:
        """The last stage runs `loss_fn(output, micro-batch target)` instead of the runner's loss meanwhile."""
        before = self.loss_fn
        self.loss_fn = loss_fn
        try:
            yield
        finally:
            self.loss_fn = before

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, forward_only: bool) -> list[torch.Tensor]:
        """One pass of the schedule over every micro-batch (forward only, or forward and backward); what the loss
        function computes on the last stage is its own business (`swapped_loss`). Returns the losses the schedule
        kept, one per micro-batch (on the last stage; none elsewhere)."""
        if forward_only:
            refusal = forward_only_refusal(self.schedule_name, "a forward-only pass (reference scores, evaluation)")
            if refusal is not None:
                raise PipelineError(refusal)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.model.has_first_stage else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.model.has_last_stage else {}
        (self.schedule.eval if forward_only else self.schedule.step)(*args, **kwargs)
        return losses

    def add_balancing(self, balancing: PipelineBalancing, group: dist.ProcessGroup | None) -> None:
        """Add the router's balancing loss to every step, its statistics taken over `group` (None: this rank)."""
        refusal = forward_only_refusal(self.schedule_name, "the router's balancing loss (it counts the routing first)")
        if refusal is not None:
            raise PipelineError(refusal)
        if not isinstance(self.loss_fn, CausalLMLoss):
            raise PipelineError(
                "the router's balancing loss under pp joins meshkit's causal-LM loss: drop loss_fn, or set "
                "output_router_logits=false in the model config"
            )
        balancing.track(self.stages)
        self.balancing, self.balancing_group = balancing, group

    def _balancing_term(self, args: tuple[Any, ...], kwargs: dict[str, Any], targets: torch.Tensor) -> torch.Tensor:
        """Count the step's routing in a forward-only pass; returns this rank's term for the step."""
        assert self.balancing is not None
        forward_only = {**kwargs, "losses": []} if self.model.has_last_stage else kwargs
        self.balancing.count(lambda: self.schedule.eval(*args, **forward_only), targets.device)
        counted = (targets != IGNORE_INDEX).reshape(self.microbatches, -1).sum(1)
        return self.balancing.prepare_terms(counted, self.loss_fn.scale, self.group, self.balancing_group)

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        grad_group: dist.ProcessGroup | None = None,
        keywords: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; gradients are left in the parameters' .grad.

        `keywords` (e.g. packed samples' `position_ids`) go to every stage, split into micro-batches like the
        inputs. With the default causal-LM loss the returned loss is the mean over every counted token of the
        step on every rank of `grad_group`."""
        if inputs.shape[0] % self.microbatches:
            raise PipelineError(
                f"the local batch of {inputs.shape[0]} does not split into pipeline.microbatches={self.microbatches}"
                ": make the per-rank batch size a multiple of it"
            )
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.model.has_first_stage else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.model.has_last_stage else {}
        token_mean = isinstance(self.loss_fn, CausalLMLoss)
        if token_mean:  # micro-batch losses are token sums, scaled to the mean over the step's tokens
            ranks = collectives.group_size(grad_group)
            tokens = collectives.reduce((targets != IGNORE_INDEX).sum(), grad_group, op="sum")
            self.loss_fn.scale = self.microbatches * ranks / max(float(tokens), 1.0)
        term = None
        if self.balancing is not None and token_mean:
            term = self._balancing_term(args, {**kwargs, **(keywords or {})}, targets)
        fused = self.loss_fn.fused if token_mean and self.model.has_last_stage else None
        with self._fused_losses(fused, targets) if fused is not None else contextlib.nullcontext():
            self.schedule.step(*args, **kwargs, **(keywords or {}))
        local = [(x.full_tensor() if isinstance(x, DTensor) else x).detach().float() for x in losses]
        loss = torch.stack(local).mean() if local else torch.zeros((), device=inputs.device)
        dist.broadcast(loss, src=self.last_stage_rank, group=self.group)  # the step's loss on every rank
        if term is not None:  # (the mean over micro-batches, as the token loss)
            loss = loss + term.to(loss) / self.microbatches
        if token_mean:
            loss = collectives.reduce(loss, grad_group, op="mean")
        return loss

    @contextlib.contextmanager
    def _fused_losses(self, fused: Any, targets: torch.Tensor) -> Iterator[None]:
        """Each micro-batch's forward on the last stage computes its loss in the head (`fused_head`), against its
        part of the targets (split as the schedule splits them); other forwards (the stage's shape inference)
        run the head as itself."""
        parts, weights = torch.tensor_split(targets, self.microbatches), self.loss_fn.weights
        last = [stage for stage in self.stages if stage.is_last]
        for stage in last:
            stage.around_forward = lambda index: fused.loss_of(parts[index], weights, fresh=False)
        try:
            yield
        finally:
            fused.forget()
            for stage in last:
                stage.around_forward = None

    def evaluate(
        self, inputs: torch.Tensor, targets: torch.Tensor, keywords: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Forward only: the summed micro-batch losses (token sums for the causal-LM loss), on every rank."""
        refusal = forward_only_refusal(self.schedule_name, "evaluation")
        if refusal is not None:
            raise PipelineError(refusal)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.model.has_first_stage else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.model.has_last_stage else {}
        scale = getattr(self.loss_fn, "scale", None)
        if scale is not None:
            self.loss_fn.scale = 1.0
        try:
            self.schedule.eval(*args, **kwargs, **(keywords or {}))
        finally:
            if scale is not None:
                self.loss_fn.scale = scale
        local = [(x.full_tensor() if isinstance(x, DTensor) else x).detach().float() for x in losses]
        total = torch.stack(local).sum() if local else torch.zeros((), device=inputs.device)
        dist.broadcast(total, src=self.last_stage_rank, group=self.group)
        return total
