"""train_step's micro-step for a causal LM's HF batch: forward, the next-token loss summed over the step's
tokens on every rank (plus the router's balancing loss of a mixture-of-experts model), backward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkit.engine.gradients import GradientSync
from meshkit.runtime import collectives
from meshkit.training.fused_head import FusedHead
from meshkit.training.loss import IGNORE_INDEX, TokenWeights, logits_of, token_loss_sum
from meshkit.training.router_loss import BalancingLoss, RouterLossError, router_logits_of


def causal_lm_micro_step(
    model: nn.Module,
    batch: tuple[dict[str, Any], torch.Tensor],
    gradients: GradientSync,
    group: dist.ProcessGroup,
    loss_parallel: Callable[[], contextlib.AbstractContextManager[Any]],
    balancing: BalancingLoss | None = None,
    balancing_over: dist.ProcessGroup | None = None,
    mask: torch.Tensor | None = None,
    weights: TokenWeights | None = None,
    fused: FusedHead | None = None,
) -> torch.Tensor:
    """One micro-step on (inputs, shifted targets); returns the step's mean loss over every rank's tokens.
    `balancing_over`: the ranks the balancing loss takes its statistics over (None: this rank alone); `mask`: the
    batch's attention mask (the balancing loss leaves padding out), as split as the inputs; `weights`: each token's
    loss weight (`Engine.weigh_token_losses`); `fused`: the head that computes the loss in its forward, without
    the logits (`meshkit.training.fused_head`)."""
    inputs, targets = batch
    with loss_parallel():
        with fused.loss_of(targets, weights) if fused is not None else contextlib.nullcontext():
            output = model(**inputs)
        total = fused.take_loss(logits_of(output)) if fused is not None else None
        if total is None:
            total = token_loss_sum(logits_of(output), targets, weights)
    count = (targets != IGNORE_INDEX).sum()
    if balancing is not None:
        router_logits = router_logits_of(output)
        if router_logits is None:
            raise RouterLossError(
                "the model's config asks for the router's balancing loss, but the model returned no router_logits"
            )
        total = total + balancing.term(router_logits, mask, count, balancing_over)
    # the step's loss sum and token count over every rank, summed while backward runs
    summed = collectives.start_sum(torch.stack((total.detach().float(), count.float())), group)
    gradients.backward(total / count.clamp(min=1), count, global_items=lambda: float(summed()[1]))
    return summed()[0] / summed()[1].clamp(min=1)
