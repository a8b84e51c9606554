"""All-gather and reduce-scatter as rings of point-to-point sends, in place: ZeRO-3's collectives on the host.

Gloo's `all_gather_into_tensor` gathers into a scratch tensor and then copies every rank's part into the output;
its `reduce_scatter_tensor` all-reduces a copy of the whole input (twice the traffic of a reduce-scatter) and
copies this rank's part out. ZeRO-3 runs both for every unit in every step. A ring does the same work as NCCL's
ring algorithms: w - 1 steps, each rank sending one part to its successor while receiving one from its
predecessor; the all-gather receives straight into the output, the reduce-scatter adds what it receives into
its own partial sums. Every rank sends and receives (w - 1) parts, the least any all-gather or reduce-scatter can.

`RingAllGather` / `RingReduceScatter` plug them into FSDP2 (`set_custom_all_gather`, torch >= 2.8).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

try:  # FSDP2's pluggable collectives (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # older torch: FSDP keeps its own collectives (`fsdp.use_ring_collectives` skips them)
    AllGather = ReduceScatter = object  # type: ignore[misc,assignment]  # stand-ins where torch lacks them


def ring_all_gather(output: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup) -> None:
    """`output` = the parts of every rank of `group`, in group-rank order; `part` is this rank's (it may already
    be a view of its place in `output`: FSDP writes it there)."""
    world, rank = group.size(), group.rank()
    parts = _parts(output, world)
    if part.data_ptr() != parts[rank].data_ptr():
        parts[rank].copy_(part)
    successor, predecessor = _neighbours(group)
    for step in range(world - 1):
        _exchange(parts[(rank - step) % world], successor, parts[(rank - step - 1) % world], predecessor, group)


def ring_reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, average: bool = False
) -> None:
    """`output` = the sum (or mean) over the ranks of `group` of this rank's part of `full`. `full` is used as
    scratch: its parts hold partial sums afterwards."""
    world, rank = group.size(), group.rank()
    parts = _parts(full, world)
    if world == 1:
        output.copy_(parts[0])
    else:
        received = torch.empty_like(output)
        successor, predecessor = _neighbours(group)
        for step in range(world - 1):  # part (rank - step - 2) gains the predecessor's partial sum of it
            _exchange(parts[(rank - step - 1) % world], successor, received, predecessor, group)
            summed = parts[(rank - step - 2) % world]
            torch.add(summed, received, out=output if step == world - 2 else summed)
    if average:
        output.div_(world)


class _PlainBuffers:
    """Communication buffers from the ordinary allocator, as FSDP's default collectives take them."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RingAllGather(_PlainBuffers, AllGather):
    """FSDP2's all-gather as `ring_all_gather`."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        ring_all_gather(output_tensor, input_tensor, group)  # done on return: FSDP waits only on a Work


class RingReduceScatter(_PlainBuffers, ReduceScatter):
    """FSDP2's reduce-scatter as `ring_reduce_scatter` for a sum or mean; any other operation (a pre-scaled sum)
    goes to the backend's own."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG:
            ring_reduce_scatter(output_tensor, input_tensor, group, average=op == dist.ReduceOp.AVG)
            return None
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _parts(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    if tensor.numel() % world:
        raise ValueError(f"a ring collective needs a tensor divisible into {world} parts, got {tensor.numel()}")
    return list(tensor.view(-1).chunk(world))


def _neighbours(group: dist.ProcessGroup) -> tuple[int, int]:
    """Global ranks of the next and the previous rank of `group` (point-to-point calls take global ranks)."""
    world, rank = group.size(), group.rank()
    return dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)


def _exchange(sent: torch.Tensor, to: int, received: torch.Tensor, source: int, group: dist.ProcessGroup) -> None:
    operations = [dist.P2POp(dist.isend, sent, to, group), dist.P2POp(dist.irecv, received, source, group)]
    for work in dist.batch_isend_irecv(operations):
        work.wait()
