"""Evaluation through the prepared model, in every layout: `Engine.eval_token_loss` (its `evaluation` component)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshkit.engine.context import EngineComponent
from meshkit.parallel.fsdp import reshard
from meshkit.runtime import collectives
from meshkit.runtime.hang_doctor import watched
from meshkit.training.loss import IGNORE_INDEX, logits_of, pipeline_pair, split_causal_lm_batch, token_loss_sum


class Evaluation(EngineComponent):
    """Runs the prepared model (or its pipeline) forward only, with the layout's sequence split and loss."""

    @watched("eval_token_loss")
    @torch.no_grad()
    def eval_token_loss(self, batch: Any) -> tuple[float, int]:
        """(summed next-token loss, tokens counted) of an HF-style causal-LM batch (`input_ids`, `labels`),
        summed over every data-parallel rank; no gradients. Every rank calls it (each with its own batch) in
        every layout, pipelines included; divide the sums of several batches for the mean loss."""
        ctx = self.ctx
        model = ctx.objects.only_model()
        inputs, targets = split_causal_lm_batch(batch, ctx.objects.label_shift)
        if ctx.mesh.size("cp") > 1:
            inputs, targets = ctx.shard_sequence((inputs, targets))
        with ctx.loss_parallel():
            if ctx.objects.pipeline is not None:
                total = ctx.objects.pipeline.evaluate(*pipeline_pair((inputs, targets), True))
            else:
                total = self._token_loss(model, inputs, targets)
        if ctx.placement.zero_stage == 3:
            reshard(model)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        count = (targets != IGNORE_INDEX).sum()
        summed = collectives.reduce(torch.stack((total.float(), count.float())), ctx.placement.metric_group, op="sum")
        return float(summed[0]), int(summed[1])

    def _token_loss(self, model: Any, inputs: dict[str, Any], targets: torch.Tensor) -> torch.Tensor:
        """The summed token loss of one forward: in the head where it computes it (`fused_loss`), else from logits."""
        fused = self.ctx.objects.fused_head
        with fused.loss_of(targets) if fused is not None else contextlib.nullcontext():
            logits = logits_of(model(**{**self.ctx.objects.training_inputs, **inputs}))
        total = fused.take_loss(logits) if fused is not None else None
        return total if total is not None else token_loss_sum(logits, targets)
