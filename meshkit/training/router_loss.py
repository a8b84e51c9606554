"""The router's load-balancing loss of a mixture-of-experts model, added to train_step's token loss.

The loss (Switch Transformer's, as transformers' MoE models define it): E · Σ_(k, e) f[k, e] · P[e], where
f[k, e] is the fraction of (layer, token) pairs whose k-th choice is expert e, and P[e] the mean router
probability of expert e, over every MoE layer and the tokens the attention mask keeps. f takes no gradient.

`micro_batch` takes f and P over each micro-batch, as the model itself does (over its cp ranks when context
parallel holds its sequence in chunks). `global_batch` takes them over every rank of the gradient group (dp × cp):
one all-reduce of the counts, and each rank's share of P enters its loss so that the averaged gradient is the one
of a single process seeing the whole batch (the global-batch balancing Qwen describes, which lets experts
specialise by domain).

train_step's loss is a token sum divided by the tokens counted over the group (`count`); the balancing term is
returned in the same units: added to the rank's token sum, it adds coefficient × the loss to the step's mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshkit.core.errors import MeshkitError


class RouterLossError(MeshkitError):
    """A balancing loss that cannot be taken; the message says what to change."""


def router_logits_of(output: Any) -> tuple[torch.Tensor, ...] | None:
    """The per-layer router logits [tokens, experts] a model returned (`output_router_logits=True`), if any."""
    logits = output.get("router_logits") if isinstance(output, dict) else getattr(output, "router_logits", None)
    if isinstance(logits, torch.Tensor):
        return (logits,)
    return tuple(logits) if logits else None


@dataclass(frozen=True)
class BalancingLoss:
    coefficient: float
    experts: int
    top_k: int
    over_global_batch: bool
    # under sequence parallel each tp rank's routers see one of `sequence_shards` contiguous parts of every
    # sequence (this rank's: `shard`; the tp ranks: `shard_group`), while the token loss counts the same tokens
    # on all of them
    sequence_shards: int = 1
    shard: int = 0
    shard_group: Any = None

    def statistics(
        self, router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(choices [k, E] summed over tokens, router probabilities [E] summed over tokens, tokens counted)."""
        logits = torch.cat(router_logits, dim=0)
        probabilities = F.softmax(logits, dim=-1)
        _, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        choices = F.one_hot(chosen, self.experts).to(probabilities.dtype)
        if mask is not None and self.sequence_shards > 1:
            mask = mask.chunk(self.sequence_shards, dim=1)[self.shard]
        if mask is None:
            keep = probabilities.new_ones(logits.shape[0])
        else:  # every layer routes the same tokens, in the order of the flattened [batch, seq] mask
            keep = mask.reshape(-1).to(probabilities.dtype).repeat(len(router_logits))
        return (choices * keep[:, None, None]).sum(0), (probabilities * keep[:, None]).sum(0), keep.sum()

    def term(
        self,
        router_logits: tuple[torch.Tensor, ...],
        mask: torch.Tensor | None,
        count: torch.Tensor,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """What to add to this rank's token-loss sum; `count`: the tokens that sum counts. `group`: the ranks whose
        tokens the fractions and probabilities are taken over (None: this rank's alone)."""
        choices, probabilities, tokens = self.statistics(router_logits, mask)
        if group is None:
            fractions = choices / tokens.clamp(min=1)
            loss = self.experts * (fractions * (probabilities / tokens.clamp(min=1))).sum()
            return self.coefficient * loss * count
        share_of_count = count.to(choices.dtype).reshape(1) / self.sequence_shards  # (counted once over tp)
        summed = torch.cat((choices.reshape(-1), tokens.reshape(1), share_of_count))
        summed = summed.detach().clone()
        dist.all_reduce(summed, group=group)
        all_tokens, all_count = summed[-2].clamp(min=1), summed[-1]
        fractions = summed[:-2].view_as(choices) / all_tokens
        # this rank's share of the group's P, weighted so that Σ over the group = its loss × its token count
        share = self.experts * (fractions * probabilities).sum() / all_tokens
        return self.whole_sequence_value(self.coefficient * share * all_count)

    def whole_sequence_value(self, term: torch.Tensor) -> torch.Tensor:
        """Under sequence parallel: `term` (this rank's part of its sequences' term) with the value of the whole
        sequences' term, so that the reported loss counts every part; the gradient stays this part's (the tp
        ranks' gradients of the routers are summed)."""
        if self.shard_group is None:
            return term
        whole = term.detach().clone()
        dist.all_reduce(whole, group=self.shard_group)
        return term + (whole - term.detach())


def balancing_loss(router_loss: Any, moe: tuple[Any, ...], mode: str) -> BalancingLoss | None:
    """The balancing loss train_step adds for a model the structure layer described (`router_loss`, `moe`)."""
    if router_loss is None or not router_loss.enabled or not router_loss.coefficient or not moe:
        return None
    top_k = moe[0].top_k
    if top_k is None:
        raise RouterLossError(
            f"the router's balancing loss needs the experts per token of {moe[0].path}: set num_experts_per_tok "
            "in the model config"
        )
    return BalancingLoss(router_loss.coefficient, moe[0].experts, top_k, mode == "global_batch")


def balancing_group(loss: BalancingLoss, mesh: Any, grad_group: Any) -> Any | None:
    """The ranks a balancing loss takes its statistics over: every dp × cp rank (global batch, `grad_group`); a
    micro-batch's cp ranks, which hold its sequence in chunks; or this rank alone — and under sequence parallel
    the tp ranks too, whose routers see other parts of the same sequences."""
    if loss.sequence_shards > 1:
        dims = ("dp_replicate", "dp_shard", "cp", "tp") if loss.over_global_batch else ("cp", "tp")
        return mesh.flat_group(dims)
    if loss.over_global_batch:
        return grad_group
    return mesh.group("cp") if mesh.size("cp") > 1 else None
