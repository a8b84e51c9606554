"""The router's balancing loss under pipeline parallel.

The loss (`training/router_loss.py`) is E · Σ_(k, e) f[k, e] · P[e] over every MoE layer, and the layers sit on
different stages: f, the fraction of routing choices per expert, spans all of them, and a stage's backward needs
it before the later stages have run the step's other micro-batches (1F1B, interleaved, zero-bubble). f takes no
gradient, and the routing is a function of the weights and the batch alone, so a forward-only pass of the step
through the same schedule counts every layer's choices first (one extra forward per step, no activations kept);
the counts are summed over the pipeline and over the ranks the loss takes its statistics over. The step itself
then adds each MoE layer's term where the layer runs: the term's gradient enters the router's logits from the
block's output (an identity whose backward adds it), so it reaches the router's weights and, through its input,
every earlier layer and stage. Its value comes from the counting pass, which routes identically.

Units: a term is in the loss function's (a token sum times `CausalLMLoss.scale`), so that the schedule's
averaging over micro-batches and the gradient average over ranks give coefficient × the loss, as one process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshkit.models.facts import ExpertFacts
from meshkit.training.router_loss import BalancingLoss


class _BalancingTerm(torch.autograd.Function):
    """Identity on a block's output; its backward adds the gradient of the balancing term Σ_(t, e) p[t, e] · w[e]
    to the router's logits (p: their softmax), so that the term reaches the router and every earlier layer.

    The weights w ride on the node itself, not among its saved tensors: under activation checkpointing the
    recomputed forward regenerates the probabilities for this node, whatever micro-batch it runs in."""

    @staticmethod
    def forward(ctx: Any, carrier: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(F.softmax(logits.float(), dim=-1))
        ctx.weights, ctx.dtype = weights, logits.dtype
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (probabilities,) = ctx.saved_tensors
        weights = ctx.weights
        return grad, (probabilities * (weights - probabilities @ weights[:, None])).to(ctx.dtype), None


def _logits(output: Any) -> torch.Tensor:
    """A router's logits [tokens, experts]: its output, or the first of its outputs (transformers' routers)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class PipelineBalancing:
    """Counts the routing of this rank's MoE layers in a forward-only pass, then adds their terms in the step."""

    def __init__(
        self, loss: BalancingLoss, chunks: list[nn.Module], moe: tuple[ExpertFacts, ...], microbatches: int
    ) -> None:
        self.loss, self.microbatches = loss, microbatches
        self.counting = False
        # each chunk's micro-batch while its stage runs one (None outside: metadata passes, recomputation)
        self.current: list[int | None] = [None] * len(chunks)
        self.pending: dict[int, torch.Tensor] = {}  # id(MoE block) -> its router's logits in this forward
        self.weights: torch.Tensor | None = None  # [microbatches, E]: d term / d (router probabilities summed)
        self._zero_statistics(torch.device("cpu"))
        for index, chunk in enumerate(chunks):
            for facts in moe:
                try:
                    block = chunk.get_submodule(facts.path)
                    router = block.get_submodule(facts.router)
                except AttributeError:  # on another stage
                    continue
                router.register_forward_hook(functools.partial(self._routed, index, id(block)))
                block.register_forward_hook(functools.partial(self._block_done, index, id(block)))

    def track(self, stages: list[Any]) -> None:
        """Follow which micro-batch each of this rank's pipeline stages (in chunk order) runs."""
        for index, stage in enumerate(stages):
            stage.forward_one_chunk = functools.partial(self._forward_one_chunk, index, stage.forward_one_chunk)

    def _forward_one_chunk(self, chunk: int, forward: Callable[..., Any], microbatch: int, *args: Any, **kwargs: Any):
        self.current[chunk] = microbatch
        try:
            return forward(microbatch, *args, **kwargs)
        finally:
            self.current[chunk] = None

    def _zero_statistics(self, device: torch.device) -> None:
        experts, top_k, m = self.loss.experts, self.loss.top_k, self.microbatches
        self.choices = torch.zeros(m, top_k, experts, device=device)
        self.probabilities = torch.zeros(m, experts, device=device)
        self.tokens = torch.zeros(m, device=device)

    def _routed(self, chunk: int, block: int, module: nn.Module, args: Any, output: Any) -> None:
        logits, m = _logits(output), self.current[chunk]
        if not self.counting:
            self.pending[block] = logits
        elif m is not None:
            probabilities = F.softmax(logits.detach().float(), dim=-1)
            _, chosen = torch.topk(probabilities, self.loss.top_k, dim=-1)
            self.choices[m] += F.one_hot(chosen, self.loss.experts).to(probabilities.dtype).sum(0)
            self.probabilities[m] += probabilities.sum(0)
            self.tokens[m] += probabilities.shape[0]

    def _block_done(self, chunk: int, block: int, module: nn.Module, args: Any, output: Any) -> Any:
        logits = self.pending.pop(block, None)
        if logits is None or self.weights is None or not torch.is_grad_enabled():
            return None
        # (outside a micro-batch — a recomputation, whose weights go unused — any row keeps the saved tensors alike)
        weights = self.weights[self.current[chunk] or 0]
        if isinstance(output, tuple):
            return (_BalancingTerm.apply(output[0], logits, weights), *output[1:])
        return _BalancingTerm.apply(output, logits, weights)

    def count(self, forward_only: Callable[[], None], device: torch.device) -> None:
        """Run the step's forward-only pass, recording every local MoE layer's choices per micro-batch."""
        self._zero_statistics(device)
        self.counting = True
        try:
            forward_only()
        finally:
            self.counting = False
            self.pending.clear()

    def prepare_terms(
        self,
        counted_targets: torch.Tensor,
        scale: float,
        pp_group: dist.ProcessGroup,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """Set each micro-batch's term weights from the counts; returns this rank's balancing term for the step
        (summed over the pipeline) in the loss function's units. `counted_targets` [microbatches]: the tokens the
        token loss counts in each micro-batch on this rank; `group`: the ranks the statistics are taken over."""
        m = self.microbatches
        routed = torch.cat((self.choices.reshape(m, -1), self.tokens[:, None]), 1)
        dist.all_reduce(routed, group=pp_group)  # every stage's layers (the counted targets are this rank's)
        counted = counted_targets.to(routed)[:, None] / self.loss.sequence_shards  # (counted once over tp)
        packed = torch.cat((routed, counted), 1)
        if self.loss.over_global_batch:  # one set of statistics for the whole step
            packed = packed.sum(0, keepdim=True).expand(m, -1).contiguous()
        if group is not None:
            dist.all_reduce(packed, group=group)
        choices, tokens = packed[:, :-2].view_as(self.choices), packed[:, -2].clamp(min=1)
        fractions = choices / tokens[:, None, None]
        # term = coefficient · E · Σ_(k, e) f[k, e] · (this layer's probabilities summed) / tokens · counted targets
        self.weights = (
            self.loss.coefficient * self.loss.experts * fractions.sum(1) / tokens[:, None] * packed[:, -1:] * scale
        )
        value = (self.weights * self.probabilities).sum().reshape(1)
        dist.all_reduce(value, group=pp_group)
        return self.loss.whole_sequence_value(value[0])
