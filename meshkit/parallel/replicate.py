"""Data-parallel gradient averaging for models DDP cannot wrap (DTensor parameters under tensor parallel).

After the last backward of an accumulation window, the local gradient tensors are flattened into buckets and
averaged with one all-reduce per bucket over the data-parallel group. No overlap with backward (DDP's hooks do
not accept DTensor parameters); zero_stage=3 (FSDP + TP) overlaps its reduce-scatters instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshkit.runtime.dtensors import local_tensor

BUCKET_BYTES = 25 * 2**20


class GradientAllReduce:
    """Averages (or sums) the gradients of `params` over `group` when asked to (see `GradientSync`)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        bucket_bytes: int = BUCKET_BYTES,
        average: bool = True,
        divisor: int | None = None,
    ) -> None:
        """`average=False`: the plain sum; `divisor`: the sum divided by it (expert banks: by every dp × cp rank,
        summed over the edp ranks only), else the average over `group`."""
        self.params = params
        self.group = group
        self.world = divisor or (dist.get_world_size(group) if average else 1)
        self.bucket_bytes = bucket_bytes

    def before_backward(self) -> None:
        """Nothing to prepare: gradients accumulate in place until the window ends."""

    def reduce_gradients(self) -> None:
        self._agree_on_present()
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in grads:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= self.bucket_bytes:
                self._all_reduce(bucket)
                bucket, size = [], 0
        if bucket:
            self._all_reduce(bucket)

    def _agree_on_present(self) -> None:
        """A gradient some rank has and this one lacks (its router sent no token to a bank) becomes zeros here,
        so every rank's buckets hold the same tensors; one that no rank has stays absent (as in one process)."""
        if not self.params:
            return
        present = torch.tensor([param.grad is not None for param in self.params], dtype=torch.int32)
        present = present.to(self.params[0].device)  # (every rank asks, whatever it holds: one small all-reduce)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
        for param, anywhere in zip(self.params, present.tolist(), strict=True):
            if anywhere and param.grad is None:
                param.grad = torch.zeros_like(param)

    def _all_reduce(self, bucket: list[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in bucket:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world)  # pre-divide, as DDP does
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
