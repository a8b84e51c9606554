"""ZeRO-1/2 gradients reduced bucket by bucket while backward goes on.

A param group's flat buffer is cut into buckets of about `bucket_mb`, in backward order (its last parameters
first), at parameter boundaries and at the boundaries of the ranks' chunks, so every bucket lies in one rank's
chunk. A `register_post_accumulate_grad_hook` on every parameter notes its gradient; a bucket whose parameters
are all in is reduced asynchronously while backward computes the earlier layers. Buckets are issued strictly in
order (a bucket waits for the ones before it), so every rank issues the same collectives in the same order
even where its gradients arrive in another.

- Stage 2, `per_micro_step` (the default): each gradient is added into a bucket buffer and freed at once; the
  bucket is reduced to the rank owning its chunk, which adds it into its gradient shard (4Ψ/N). At most
  `IN_FLIGHT` bucket buffers exist at a time: the peak holds the shard, two buckets and the gradients
  autograd has not handed over yet — never the full 4Ψ. Accumulation reduces every micro-step (traffic ×
  accumulation steps).
- Stage 2, once per window: gradients are added into a full flat buffer (4Ψ, freed after the window); its
  buckets are reduced to their owners during the last micro-step's backward (traffic once).
- Stage 1: gradients are views of a full flat buffer (4Ψ, allocated once and kept, as DDP keeps its buckets;
  tensor-parallel DTensor gradients are copied into it, as they cannot be views); its buckets are reduced to
  their owners during the last micro-step's backward — as the ZeRO paper's P_os does: each rank steps its own
  chunk only, so an all-reduce would send every gradient twice (measured that way: stage 1 stepped at 1.14×
  stage 2's time at world 4; reduced to owners, 0.78× what it was). Only the owner's chunk holds the average
  afterwards, so the parameters' `.grad` are let go then; the chunk is the optimizer's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.parallel.zero import BUCKETS_IN_FLIGHT

IN_FLIGHT = BUCKETS_IN_FLIGHT  # bucket buffers in use at a time (stage 2 per micro-step)


@dataclass
class Bucket:
    start: int  # range [start, end) of the group's flat buffer
    end: int
    owner: int  # the rank (in the dp group) whose chunk holds the range
    members: list[int] = field(default_factory=list)  # indices of the parameters overlapping the range


def plan_buckets(slices: list[tuple[int, int]], chunk: int, bucket_numel: int) -> list[Bucket]:
    """Buckets over the parameters at `slices` (offset, size), in backward order: cut every `bucket_numel`
    elements at parameter boundaries, and at every multiple of `chunk` (a rank's share)."""
    total = sum(size for _, size in slices)
    cuts = {0, total}
    cuts.update(range(chunk, total, chunk))
    gathered = 0
    for offset, size in reversed(slices):
        gathered += size
        if gathered >= bucket_numel:
            cuts.add(offset)
            gathered = 0
    edges = sorted(cuts)
    buckets = [Bucket(a, b, a // chunk) for a, b in zip(edges, edges[1:], strict=False) if b > a]
    for bucket in buckets:
        bucket.members = [i for i, (o, s) in enumerate(slices) if o < bucket.end and o + s > bucket.start and s]
    return list(reversed(buckets))


class BucketedReduce:
    """One param group's gradient reduction during backward (see the module text)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        slices: list[tuple[int, int]],
        chunk: int,
        group: dist.ProcessGroup,
        stage: int,
        bucket_numel: int,
        per_micro_step: bool,
        holder: nn.Parameter | None = None,
    ) -> None:
        """`holder`: the parameter whose `.grad` is this rank's gradient chunk (the optimizer's shard)."""
        self.params, self.slices, self.chunk, self.group, self.stage = params, slices, chunk, group, stage
        self.per_micro_step = per_micro_step and stage == 2
        # gradients are copied out of the parameters (stage 2; tensor-parallel DTensors, which cannot be views)
        self.copies = stage == 2 or any(isinstance(p, DTensor) for p in params)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.buckets = plan_buckets(slices, chunk, max(1, bucket_numel))
        self.of_param: list[list[int]] = [[] for _ in params]
        for index, bucket in enumerate(self.buckets):
            for member in bucket.members:
                self.of_param[member].append(index)
        self.full: torch.Tensor | None = None  # stage 1, or stage 2 once per window: the full gradients
        self._spent = False  # the full buffer holds a reduced window (zeroed when the next one starts)
        self.shard_grad: torch.Tensor | None = None  # stage 2: this rank's reduced chunk
        self.holder = holder
        self._armed = False  # hooks act between before_backward and after_backward only
        self._launching = False  # this backward reduces (every micro-step, or the window's last)
        self._pending: list[int] = []
        self._buffers: dict[int, torch.Tensor] = {}
        self._issued = 0
        self._in_flight: list[tuple[int, torch.Tensor, Any]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    # ------------------------------------------------------------------ backward
    def before_backward(self, final: bool, template: torch.Tensor) -> None:
        self._armed, self._launching = True, self.per_micro_step or final
        self._pending = [len(bucket.members) for bucket in self.buckets]
        self._issued = 0
        if self.stage == 2 and self.per_micro_step:
            return
        # gradients accumulate in place in views of the full buffer (re-attached after a model.zero_grad() too)
        attach = not self.copies and any(p.grad is None for p in self.params)
        if self.full is None:
            self.full = torch.zeros_like(template)
        elif self._spent or attach:  # kept from the last window (stage 1): it still holds that window's sums
            self.full.zero_()
        self._spent = False
        if attach:
            for param, (offset, size) in zip(self.params, self.slices, strict=True):
                param.grad = self.full[offset : offset + size].view_as(param)

    def _make_hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self._armed:
                self._arrived(index, param)

        return hook

    def _full(self) -> torch.Tensor:
        if self.full is None:
            raise RuntimeError("ZeRO: a gradient arrived outside a window (the full gradient buffer is not set up)")
        return self.full

    def _arrived(self, index: int, param: torch.Tensor) -> None:
        offset, size = self.slices[index]
        if self.copies:
            grad = _local_grad(param).reshape(-1)
            if self.per_micro_step:
                for b in self.of_param[index]:
                    bucket = self.buckets[b]
                    lo, hi = max(offset, bucket.start), min(offset + size, bucket.end)
                    self._buffer(b)[lo - bucket.start : hi - bucket.start].add_(grad[lo - offset : hi - offset])
            else:
                self._full()[offset : offset + size].add_(grad)
            param.grad = None  # the gradient lives in a bucket (or the full buffer) now
        for b in self.of_param[index]:
            self._pending[b] -= 1
        if self._launching:
            self._issue_ready()

    def _buffer(self, index: int) -> torch.Tensor:
        if index not in self._buffers:
            while len(self._buffers) >= IN_FLIGHT and self._in_flight:  # bound the buffers: finish the oldest
                self._finish_oldest()
            bucket = self.buckets[index]
            self._buffers[index] = torch.zeros(bucket.end - bucket.start, dtype=self.params[0].dtype,
                                               device=self.params[0].device)  # fmt: skip
        return self._buffers[index]

    def _issue_ready(self) -> None:
        while self._issued < len(self.buckets) and self._pending[self._issued] <= 0:
            self._issue(self._issued)
            self._issued += 1

    def _issue(self, index: int) -> None:
        bucket = self.buckets[index]
        data = self._buffer(index) if self.per_micro_step else self._full()[bucket.start : bucket.end]
        data.div_(self.world)  # pre-divided, as DDP does, so the sum cannot overflow
        owner = dist.get_global_rank(self.group, bucket.owner)
        work = dist.reduce(data, dst=owner, group=self.group, async_op=True)
        self._in_flight.append((index, data, work))

    def _finish_oldest(self) -> None:
        index, data, work = self._in_flight.pop(0)
        work.wait()
        bucket = self.buckets[index]
        if self.stage == 2 and bucket.owner == self.rank:
            if self.shard_grad is None:
                self.shard_grad = torch.zeros(self.chunk, dtype=data.dtype, device=data.device)
                if self.holder is not None:  # held from here on (what memory reports count)
                    self.holder.grad = self.shard_grad
            base = self.rank * self.chunk
            self.shard_grad[bucket.start - base : bucket.end - base].add_(data)
        self._buffers.pop(index, None)

    def after_backward(self) -> None:
        """Issue what backward left (parameters without a gradient count as zeros) and wait for all of it."""
        if self._launching:
            for index in range(self._issued, len(self.buckets)):
                self._issue(index)
            self._issued = len(self.buckets)
            while self._in_flight:
                self._finish_oldest()
            if self.stage == 2:
                self.full = None  # (once per window: reduced into the shard, no longer needed)
            else:  # outside this rank's chunk the views hold its own, unreduced sums: nobody may read them
                for param in self.params:
                    param.grad = None
                self._spent = True
        self._armed = False

    # ------------------------------------------------------------------ after the window
    def reduced_shard(self, bounds: tuple[int, int], template: torch.Tensor) -> torch.Tensor | None:
        """This rank's averaged gradient chunk (stage 1: a view of the full gradients)."""
        if self.stage == 1:
            return self.full[bounds[0] : bounds[1]] if self.full is not None else None
        if self.shard_grad is None:  # no bucket of this rank's chunk holds a parameter (padding only)
            self.shard_grad = torch.zeros_like(template)
        return self.shard_grad

    def release(self) -> None:
        """After the step: the gradients are not needed any more (stage 1 keeps its full buffer for the next
        window, zeroed when that window starts)."""
        self.shard_grad = None
        if self.stage == 2:
            self.full = None
        for param in self.params:
            param.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient as this rank holds it: a tensor-parallel DTensor's local shard, in the parameter's own
    placement (a partial sum over the tp ranks is reduced first)."""
    grad = param.grad
    if grad is None:
        raise RuntimeError("ZeRO: a gradient hook fired for a parameter without a gradient")
    if isinstance(grad, DTensor):
        if isinstance(param, DTensor) and grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad._local_tensor
    return grad
