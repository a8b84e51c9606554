"""The step: accumulation, backward with its scaling, clipping, and the one-call steps (`train_step`,
`objective_step`) — the Engine's verbs for a training loop (`engine.train_step` is `engine.stepping.train_step`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.engine.causal_step import causal_lm_micro_step
from meshkit.engine.context import EngineContext
from meshkit.engine.gradients import GradientSync, clip_arguments
from meshkit.engine.objective_step import objective_micro_step
from meshkit.runtime.hang_doctor import HangDoctor, watched
from meshkit.training.loss import (
    CausalLMLoss,
    TokenWeights,
    compute_loss,
    is_causal_lm_batch,
    pipeline_pair,
    split_causal_lm_batch,
)
from meshkit.training.objective import Objective, ObjectiveResult


class Stepping:
    """Reads the layout's gradient sync through `gradients` (made again when `layout: auto` settles) and the
    checkpointed step through `step` (what the hang doctor names when a peer never arrives)."""

    def __init__(self, ctx: EngineContext, gradients: Callable[[], GradientSync], step: Callable[[], int]) -> None:
        self.ctx = ctx
        self._gradients_now = gradients
        self._step_now = step

    @property
    def _gradients(self) -> GradientSync:
        return self._gradients_now()

    @property
    def hang_doctor(self) -> HangDoctor | None:
        return self.ctx.hang_doctor

    @property
    def step(self) -> int:
        return self._step_now()

    def accumulate(self, *models: nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-step: gradients synchronise (and the optimizer steps) on every grad_accum_steps-th. Models
        may be named, as with Accelerate (`accumulate(model)`); every prepared model takes part either way."""
        return self._gradients.accumulate()

    @watched("backward")
    def backward(
        self, loss: torch.Tensor, *, num_items: float | torch.Tensor | None = None, **backward_options: Any
    ) -> None:
        """Backward with accumulation scaling (and fp16 loss scaling).

        Without `num_items` each micro-step's loss counts 1/grad_accum_steps. With it, `loss` is the mean over
        `num_items` items (e.g. tokens) and the final gradient is the mean over every item of the window on
        every dp rank — the right average when micro-batches hold different numbers of tokens.
        `backward_options` (retain_graph, inputs, ...) go to torch's `backward`.
        """
        if (
            num_items is None and self.ctx.objects.uneven is not None
        ):  # per-rank batch sizes: weigh each rank by its samples
            mine, total = self.ctx.objects.uneven
            self._gradients.backward(loss, mine, global_items=lambda: float(total), **backward_options)
            return
        self._gradients.backward(loss, num_items, **backward_options)

    def clip_grad_norm_(self, *args: Any, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip every prepared model's gradients (unscaled first under fp16); None on non-syncing micro-steps.
        `(max_norm[, norm_type])`, or Accelerate's `(parameters, max_norm[, norm_type])`."""
        return self._gradients.clip_grad_norm_(*clip_arguments(args, norm_type))

    def weigh_token_losses(self, weights: TokenWeights | None) -> None:
        """train_step's causal-LM loss: each counted token's cross-entropy times `weights(logits, targets)` (computed
        without gradient; under tensor parallel the logits are vocab-sharded DTensors), still divided by the step's
        token count — on every pipeline stage that computes the loss too. None: the plain mean again."""
        objects = self.ctx.objects
        objects.token_weights = weights
        if objects.pipeline is not None and isinstance(objects.pipeline.loss_fn, CausalLMLoss):
            objects.pipeline.loss_fn.weights = weights

    def leave_out_of_steps(self, parameters: list[nn.Parameter]) -> None:
        """The coming optimizer steps leave these (prepared) parameters as they are, as if frozen — their gradients
        are dropped before clipping — until the next call (an empty list: every parameter steps again)."""
        self._gradients.leave_out(parameters)

    def loss_parallel(self) -> contextlib.AbstractContextManager[Any]:
        """Where the loss is computed from vocab-sharded logits (tensor parallel): cross-entropy without ever
        gathering the full logits. `train_step` and `backward` enter it themselves; a hand-written loop wraps
        its loss computation: `with engine.loss_parallel(): loss = loss_fn(model(x), y)`."""
        return self.ctx.loss_parallel()

    def shard_sequence(self, batch: Any, dim: int = 1) -> Any:
        """Under context parallel, this rank's two chunks of every tensor's sequence dim (`train_step` does
        it itself; a hand-written loop calls it on each batch). Without cp the batch is returned as is."""
        return self.ctx.shard_sequence(batch, dim)

    @watched("train_step")
    def train_step(self, batch: Any) -> torch.Tensor:
        """Forward, backward and (on syncing micro-steps) clip, optimizer and scheduler step; returns the loss."""
        objects = self.ctx.objects
        model, optimizer = objects.only_model(), objects.only_optimizer()
        causal = objects.loss_fn is None and objects.causal_lm and is_causal_lm_batch(batch)
        mask = batch.get("attention_mask") if causal and objects.balancing[0] is not None else None
        if causal:  # labels shifted before any sequence split; the loss is the mean over the step's tokens
            batch = split_causal_lm_batch(batch, objects.label_shift)
        if self.ctx.mesh.size("cp") > 1:
            batch = self.shard_sequence(batch)
            mask = None if mask is None else self.shard_sequence(mask)
        with self.accumulate():
            if objects.pipeline is not None:
                with self.loss_parallel():
                    inputs, targets, keywords = pipeline_pair(batch, causal)
                    loss = objects.pipeline.step(inputs, targets, self.ctx.mesh.grad_group, keywords)
                self._gradients.reduce_after_schedule()
            elif causal:
                group, balancing = self.ctx.placement.grad_group, objects.balancing
                batch = ({**objects.training_inputs, **batch[0]}, batch[1])  # (a pipeline stage adds its own)
                loss = causal_lm_micro_step(
                    model,
                    batch,
                    self._gradients,
                    group,
                    self.loss_parallel,
                    *balancing,
                    mask,
                    objects.token_weights,
                    objects.fused_head,
                )
            else:
                with self.loss_parallel():
                    loss = compute_loss(model, batch, objects.loss_fn)
                self.backward(loss)
            self._optimizer_step(optimizer)
        loss = loss.detach()
        return loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss parallel: a replicated DTensor

    @watched("objective_step")
    def objective_step(self, batch: Any, objective: Objective) -> ObjectiveResult:
        """`train_step` for an objective over whole sequences (`meshkit.training.preference`): every rank's
        examples weigh alike; returns the result with `loss` the mean over every rank's examples."""
        with self.accumulate():
            result = objective_micro_step(self.ctx, objective, batch, self._gradients)
            self._optimizer_step(self.ctx.objects.only_optimizer())
        return result

    def _optimizer_step(self, optimizer: Any) -> None:
        self._gradients.step(optimizer, self.ctx.objects.schedulers, self.ctx.config.max_grad_norm)
