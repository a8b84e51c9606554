"""Collectives over the data-parallel group for metrics: gather, gather without padding, reduce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from meshkit.core.tree import map_tensors
from meshkit.runtime.ring_collectives import ring_all_gather, ring_reduce_scatter


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def gather_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate `tensor` from every rank of `group` along dim 0, in rank order (0-d tensors become 1-d)."""
    tensor = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    size = group_size(group)
    if size == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def gather(data: Any, group: dist.ProcessGroup | None) -> Any:
    """`gather_tensor` on every tensor of a nested structure; every rank must pass the same shapes."""
    return map_tensors(lambda t: gather_tensor(t, group), data)


def gather_object(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """A picklable object from every rank of `group`, as a list in rank order (for non-tensor metrics)."""
    size = group_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def drop_padding(gathered: torch.Tensor, valid_per_rank: list[int]) -> torch.Tensor:
    """Keep the first `valid_per_rank[r]` rows of each rank's equal-sized block of a gathered tensor."""
    block = gathered.shape[0] // len(valid_per_rank)
    if all(valid == block for valid in valid_per_rank):
        return gathered
    keep = [gathered[r * block : r * block + valid] for r, valid in enumerate(valid_per_rank)]
    return torch.cat(keep)


def in_sampler_order(gathered: torch.Tensor, valid_per_rank: list[int]) -> torch.Tensor:
    """Rows of a gathered batch in the sampler's order, padding dropped. A DistributedSampler deals sample
    positions round-robin (rank r's j-th row is position j·world + r), so interleaving the ranks' blocks restores
    the order of the data: an unshuffled evaluation set comes back in dataset order, as Accelerate returns it."""
    world = len(valid_per_rank)
    block = gathered.shape[0] // world
    if block * world != gathered.shape[0] or block < max(valid_per_rank):
        return drop_padding(gathered, valid_per_rank)  # (rows are not this batch's samples)
    order = [r * block + j for j in range(block) for r in range(world) if j < valid_per_rank[r]]
    return gathered[torch.tensor(order, device=gathered.device)]


def reduce(data: Any, group: dist.ProcessGroup | None, op: str = "mean") -> Any:
    """All-reduce every tensor of a nested structure with `op` ('mean', 'sum' or 'max'); returns new tensors."""
    if op not in ("mean", "sum", "max"):
        raise ValueError(f"reduce op must be 'mean', 'sum' or 'max', got {op!r}")
    size = group_size(group)
    torch_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM

    def reduce_one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()
        if size > 1:
            dist.all_reduce(out, op=torch_op, group=group)
        return out / size if op == "mean" else out

    return map_tensors(reduce_one, data)


def start_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> Callable[[], torch.Tensor]:
    """Start summing `tensor` over `group` in the background; the returned function waits (once) and gives the
    sum. Lets a small all-reduce run while the caller computes (e.g. a loss's token count during backward)."""
    out = tensor.detach().clone()
    work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=True) if group_size(group) > 1 else None

    def result() -> torch.Tensor:
        nonlocal work
        if work is not None:
            work.wait()
            work = None
        return out

    return result


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's `shard`, concatenated into `output` in rank order (`shard` may be a view of `output`).

    On gloo, a ring of sends straight into `output` (`ring_all_gather`): gloo's own all-gather stages the whole
    output in a buffer of its own (a second copy of every parameter for ZeRO-1/2's gather) and copies it out.
    """
    if _on_gloo(group):
        ring_all_gather(output, shard, _group(group))
        return
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    gather_single(output, shard, group=group)


def reduce_scatter_flat(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum `full` over the ranks of `group`; rank r receives chunk r of the sum in `shard`. On gloo `full` is
    scratch afterwards (`ring_reduce_scatter`: gloo's own all-reduces a copy of all of it, twice the traffic)."""
    if _on_gloo(group):
        ring_reduce_scatter(shard, full, _group(group))
        return
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.13
    scatter_single(shard, full, group=group)


def _on_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD)  # (set once initialised)


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """`obj` from rank `src` on every rank (small control values: errors, chosen paths)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
