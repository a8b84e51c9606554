"""ZeRO stages 1 and 2: optimizer states (and, for stage 2, gradients) sharded over the data-parallel ranks.

Each optimizer param group's parameters are moved into one flat buffer, padded to a multiple of the dp size;
the parameters become views of it, and rank r owns the contiguous chunk r. The user's optimizer is rebuilt
(same class and hyper-parameters) over the chunk, which is itself a view of the flat buffer: the step updates
the model's weights in place, then one all-gather hands every rank the others' chunks.

Per rank, with Ψ parameters, N dp ranks and Adam in fp32 (bytes of storage held between steps):
    stage 1: params 4Ψ + full gradients 4Ψ (reduced to their owners; kept between steps) + optimizer 8Ψ/N
    stage 2: params 4Ψ + gradient chunk 4Ψ/N (reduced to its owner)          + optimizer 8Ψ/N
Gradients are reduced in buckets while backward goes on (`meshkit.parallel.zero.buckets`), so stage 2 never
holds the full 4Ψ (unless `zero.reduce_every_micro_step: false` keeps it over an accumulation window).
Pipeline stages (whose schedule runs many backward passes per step) and groups holding parameters another
reducer finishes after backward (summed over tp first) reduce once after backward instead. Under expert
parallel each group's expert banks (this rank's experts) have a flat buffer of their own, chunked over the ranks
that hold the same experts (`ExpertShards`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.core.errors import MeshkitError
from meshkit.parallel.zero.buckets import BucketedReduce
from meshkit.runtime.collectives import all_gather_flat, reduce_scatter_flat
from meshkit.runtime.dtensors import local_tensor
from meshkit.training.wrapped_optimizer import WrappedOptimizer


class ZeroError(MeshkitError):
    """An optimizer ZeRO-1/2 cannot shard; the message says what to change."""


@dataclass(frozen=True)
class ExpertShards:
    """Expert banks split over ep: each rank's own experts go into flat buffers of their own, chunked over the
    `group` of ranks that hold the same experts (edp); their gradients are summed there and divided by every
    data-parallel rank (`divisor` = dp × cp: a bank's gradient holds the tokens its whole ep group routed to it)."""

    params: frozenset[int]  # ids of the banks' parameters
    group: dist.ProcessGroup
    divisor: int


class FlatShard:
    """Parameters of one param group in one flat buffer, chunked over `group`; this rank steps its chunk."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        stage: int,
        overlap: tuple[int, bool, set[int]] | None = None,
        experts: ExpertShards | None = None,
        group_index: int = 0,
    ) -> None:
        """`overlap`: (bucket bytes, reduce every micro-step, ids of parameters another reducer finishes after
        backward — a group holding one reduces after backward too) to reduce in buckets during backward.
        `experts`: these are expert-bank parameters (reduced after backward over the experts' group)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.group_index = group_index  # the optimizer param group they came from
        self.expert = experts is not None
        self.divisor = experts.divisor if experts is not None else world
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ZeroError(
                f"zero_stage {stage} needs one dtype per optimizer param group, found {sorted(map(str, dtypes))}"
            )
        self.params = params
        self.stage = stage
        self.world = world
        # Tensor-parallel parameters are DTensors: this rank flattens its local shards (their gradients are
        # copied in after backward, since a DTensor's gradient cannot be made a view of a plain buffer).
        self.distributed = any(isinstance(p, DTensor) for p in params)
        locals_ = [local_tensor(p) for p in params]
        numel = sum(t.numel() for t in locals_)
        self.chunk = math.ceil(numel / world)
        self.flat = torch.zeros(self.chunk * world, dtype=params[0].dtype, device=locals_[0].device)
        self.slices: list[tuple[int, int]] = []
        offset = 0
        with torch.no_grad():
            for param, local in zip(params, locals_, strict=True):
                size = local.numel()
                view = self.flat[offset : offset + size].view_as(local)
                view.copy_(local)
                if isinstance(param, DTensor):
                    param._local_tensor = view  # the same DTensor parameter, its shard now in the flat buffer
                else:
                    param.data = view  # same Parameter, new storage
                self.slices.append((offset, size))
                offset += size
        self.bounds = (rank * self.chunk, (rank + 1) * self.chunk)
        # A view: the optimizer's in-place update is the model's update.
        self.shard = nn.Parameter(self.flat[self.bounds[0] : self.bounds[1]])
        self.flat_grad: torch.Tensor | None = None
        self._attached = False  # the parameters' .grad are views of flat_grad (attach_grads)
        self.bucketed = (
            BucketedReduce(
                params,
                self.slices,
                self.chunk,
                group,
                stage,
                overlap[0] // self.flat.element_size(),
                overlap[1],
                self.shard,
            )
            if overlap is not None and not self.expert and not any(id(p) in overlap[2] for p in params)
            else None
        )

    def before_backward(self, final: bool) -> None:
        if self.bucketed is not None:
            self.bucketed.before_backward(final, self.flat)
        else:
            self.attach_grads()

    def after_backward(self) -> None:
        if self.bucketed is not None:
            self.bucketed.after_backward()

    def attach_grads(self) -> None:
        """Before backward: make every parameter's .grad a view of one flat gradient buffer."""
        if self.distributed:
            return  # DTensor gradients accumulate in their own tensors; `reduce` copies them in
        if self.flat_grad is not None and all(p.grad is not None for p in self.params):
            return
        if self.flat_grad is None:
            self.flat_grad = torch.zeros_like(self.flat)
        else:  # stage 1 keeps its buffer from window to window
            self.flat_grad.zero_()
        for param, (offset, size) in zip(self.params, self.slices, strict=True):
            param.grad = self.flat_grad[offset : offset + size].view_as(param)
        self._attached = True

    def reduce(self) -> None:
        """After the last backward of a window: average the gradients over the dp ranks."""
        if self.bucketed is not None:  # reduced during backward already
            self.shard.grad = self.bucketed.reduced_shard(self.bounds, self.shard.detach())
            return
        if self.distributed or not self._attached:  # gradients in their own tensors (DTensor; a pipeline's)
            self._collect_grads()
        if self.flat_grad is None:
            self.shard.grad = None
            return
        self.flat_grad.div_(self.divisor)  # pre-divide, as DDP does, so the sum cannot overflow
        # each rank steps its own chunk: a reduce-scatter (an all-reduce would send every gradient twice)
        shard_grad = torch.empty_like(self.shard)
        reduce_scatter_flat(shard_grad, self.flat_grad, self.group)
        self.shard.grad = shard_grad
        for param in self.params:  # the full gradients hold this rank's own sums: nobody may read them
            param.grad = None
        if self.stage == 2 or not self._attached:
            self.flat_grad, self._attached = None, False  # (stage 1 keeps its buffer for the next window)

    def _collect_grads(self) -> None:
        if all(p.grad is None for p in self.params):
            self.flat_grad = None
            return
        self.flat_grad = torch.zeros_like(self.flat)
        for param, (offset, size) in zip(self.params, self.slices, strict=True):
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
                grad = grad.redistribute(param.device_mesh, param.placements)  # e.g. a partial sum: reduce it
            self.flat_grad[offset : offset + size].copy_(local_tensor(grad).reshape(-1))
            param.grad = None  # the flat copy is the gradient from here on

    def norm_weights(self, tp_size: int) -> torch.Tensor | None:
        """Per element of this rank's chunk: 1, or 1/tp for a parameter every tensor-parallel rank holds whole
        (its gradient would otherwise count tp times in a norm summed over the tp ranks). Expert banks stay whole
        on every tp rank."""
        if not self.distributed or tp_size == 1:
            return None
        if self.expert:
            return torch.full_like(self.shard.detach(), 1.0 / tp_size)
        weights = torch.ones_like(self.flat)
        for param, (offset, size) in zip(self.params, self.slices, strict=True):
            sharded = isinstance(param, DTensor) and any(placement.is_shard() for placement in param.placements)
            if not sharded:
                weights[offset : offset + size] = 1.0 / tp_size
        return weights[self.bounds[0] : self.bounds[1]]

    def gather(self) -> None:
        """After the step: every rank receives the others' updated chunks."""
        all_gather_flat(self.flat, self.shard.detach(), self.group)

    def zero_grad(self) -> None:
        if self.bucketed is not None:
            self.bucketed.release()
            self.shard.grad = None
            return
        if self.distributed or not self._attached:
            self.flat_grad = None
            self.shard.grad = None
            for param in self.params:
                param.grad = None
            return
        if self.flat_grad is not None and any(p.grad is not None for p in self.params):
            self.flat_grad.zero_()  # (mid-window: the views stay and start again from zero)
        self.shard.grad = None


def rebuild_optimizer(optimizer: torch.optim.Optimizer, shards: list[FlatShard]) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters, over each param group's chunk parameters (one, and one
    more for its expert banks under expert parallel)."""
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [s.shard for s in shards if s.group_index == i]}
        for i, group in enumerate(optimizer.param_groups)
    ]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # per-group values win anyway
    try:
        return type(optimizer)(groups, **defaults)
    except TypeError as err:
        raise ZeroError(
            f"zero_stage 1/2 rebuilds the optimizer over the shards, but {type(optimizer).__name__} could not be "
            f"rebuilt from its param groups and defaults ({err}); use a torch.optim optimizer or zero_stage=3"
        ) from None


class ZeroOptimizer(WrappedOptimizer):
    """Steps this rank's chunk with the rebuilt optimizer, then all-gathers the updated parameters."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup,
        stage: int,
        wrap_inner: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
        tp_group: dist.ProcessGroup | None = None,
        overlap: tuple[int, bool, set[int]] | None = None,
        experts: ExpertShards | None = None,
    ) -> None:
        """`overlap`: (bucket bytes, reduce every micro-step, parameters reduced elsewhere), see `FlatShard`;
        `experts`: the expert banks' parameters under expert parallel, chunked over their own group."""
        # Deliberately no super().__init__: the inner optimizer keeps all the state.
        if optimizer.state:
            raise ZeroError("prepare() the optimizer before its first step: zero_stage 1/2 cannot shard existing state")
        self.group = group
        self.tp_group = tp_group  # tensor parallel: the chunks hold local shards, a norm sums over tp too
        self.stage = stage
        self.shards: list[FlatShard] = []
        for index, param_group in enumerate(optimizer.param_groups):
            # A frozen parameter never has a gradient, so torch's optimizers never step it: it stays out of the
            # chunks (weight decay on a zero gradient would move it).
            trainable = [p for p in param_group["params"] if p.requires_grad]
            banks = [p for p in trainable if experts is not None and id(p) in experts.params]
            others = [p for p in trainable if experts is None or id(p) not in experts.params]
            if others:
                self.shards.append(FlatShard(others, group, stage, overlap, group_index=index))
            if banks and experts is not None:
                self.shards.append(FlatShard(banks, experts.group, stage, None, experts, index))
        inner = rebuild_optimizer(optimizer, self.shards)
        self.inner = wrap_inner(inner) if wrap_inner else inner
        # An LR scheduler built on the user's optimizer keeps driving it: let it see the rebuilt groups.
        optimizer.param_groups = inner.param_groups
        self._reduced = False

    def wrapped(self) -> torch.optim.Optimizer:
        return self.inner

    def before_backward(self, final: bool = True) -> None:
        """`final`: this backward ends an accumulation window (its gradients are reduced)."""
        for shard in self.shards:
            shard.before_backward(final)

    def after_backward(self) -> None:
        for shard in self.shards:
            shard.after_backward()

    def scale_reduced(self, factor: float) -> None:
        """Scale gradients already reduced into the chunks (in buckets during backward: the parameters' own
        `.grad` were let go, so scaling those scaled nothing)."""
        for shard in self.shards:
            bucketed = shard.bucketed
            if bucketed is not None and shard.shard.grad is not None:
                shard.shard.grad.mul_(factor)

    def reduce_gradients(self) -> None:
        for shard in self.shards:
            shard.reduce()
        self._reduced = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm from the chunks (one all-reduce: the expert chunks too, as the edp × ep ranks that hold
        them are the dp × cp ranks), then scale the chunks' gradients."""
        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        pairs = [(s.shard.grad, s.norm_weights(tp)) for s in self.shards if s.shard.grad is not None]
        grads = [grad for grad, _ in pairs]
        groups = [self.group] + ([self.tp_group] if tp > 1 else [])
        if norm_type == math.inf:
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros(())
            for group in groups:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            total = local
        else:
            powers = [(grad.float().abs() ** norm_type, weights) for grad, weights in pairs]
            local = sum(((p * w).sum() if w is not None else p.sum() for p, w in powers), torch.zeros(()))
            for group in groups:
                dist.all_reduce(local, group=group)
            total = local ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp this rank's gradient chunks elementwise (the reduced gradients: the same as clamping whole)."""
        for shard in self.shards:
            if shard.shard.grad is not None:
                shard.shard.grad.clamp_(-clip_value, clip_value)

    def step(self, closure: Any = None) -> Any:
        if not self._reduced and any(p.grad is not None for s in self.shards for p in s.params):
            raise ZeroError(
                f"zero_stage {self.stage} reduces gradients in engine.backward(loss): "
                "call it instead of loss.backward()"
            )
        self._reduced = False
        result = self.inner.step(closure) if closure else self.inner.step()
        for shard in self.shards:
            shard.gather()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            shard.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, {self.inner!r})"
