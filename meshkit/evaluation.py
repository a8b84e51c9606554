"""Evaluation through the prepared model, in every layout: `Engine.eval_token_loss` (a mixin of `Engine`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshkit.hang_doctor import watched
from meshkit.loss import IGNORE_INDEX, logits_of, pipeline_pair, split_causal_lm_batch, token_loss_sum
from meshkit.parallel.fsdp import reshard


class EvaluationMixin:
    """Uses the engine's prepared model, mesh, pipeline runner and zero stage."""

    _models: list[Any]
    _pipeline: Any
    mesh: Any
    zero_stage: int

    @watched("eval_token_loss")
    @torch.no_grad()
    def eval_token_loss(self, batch: Any) -> tuple[float, int]:
        """(summed next-token loss, tokens counted) of an HF-style causal-LM batch (`input_ids`, `labels`),
        summed over every data-parallel rank; no gradients. Every rank calls it (each with its own batch) in
        every layout, pipelines included; divide the sums of several batches for the mean loss."""
        model = self._only("model", self._models)  # type: ignore[attr-defined]
        inputs, targets = split_causal_lm_batch(batch)
        if self.mesh.size("cp") > 1:
            inputs, targets = self.shard_sequence((inputs, targets))  # type: ignore[attr-defined]
        with self.loss_parallel():  # type: ignore[attr-defined]
            if self._pipeline is not None:
                total = self._pipeline.evaluate(*pipeline_pair((inputs, targets), True))
            else:
                total = token_loss_sum(logits_of(model(**inputs)), targets)
        if self.zero_stage == 3:
            reshard(model)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        count = (targets != IGNORE_INDEX).sum()
        summed = self.reduce(torch.stack((total.float(), count.float())), "sum")  # type: ignore[attr-defined]
        return float(summed[0]), int(summed[1])
