"""The flat all-gather and reduce-scatter ZeRO-1/2/3 use: on gloo, rings of sends in place (`ring_collectives`).
Each equals gloo's own collective exactly (sums of integers in fp32 have no rounding), in the world and in a
subgroup whose ranks are not 0..n-1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshkit.runtime.collectives import all_gather_flat, reduce_scatter_flat
from meshkit.runtime.ring_collectives import RingAllGather, RingReduceScatter
from tests.helpers.distributed import leave_world, run_world

SHARD = 1000  # elements per rank


def _collectives(rank: int) -> dict:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results: dict = {}
    for name, group in (("world", None), ("odd", dist.new_group([1, 3]))):
        if group is not None and rank not in (1, 3):
            continue
        size = dist.get_world_size(group)
        member = dist.get_rank(group)
        gathered = torch.zeros(SHARD * size)
        gathered[member * SHARD : (member + 1) * SHARD] = torch.arange(SHARD) + 10_000 * rank
        all_gather_flat(gathered, gathered[member * SHARD : (member + 1) * SHARD], group)  # in place
        full = torch.arange(SHARD * size, dtype=torch.float32) * (rank + 1)
        reference = torch.empty(SHARD)
        dist.reduce_scatter_tensor(reference, full.clone(), group=group)
        shard = torch.empty(SHARD)
        reduce_scatter_flat(shard, full, group)
        results[name] = {"gathered": gathered, "shard": shard, "reference": reference}
    # FSDP2's pluggable collectives: a separate input, and a mean
    output, part = torch.zeros(SHARD * world), torch.full((SHARD,), float(rank))
    RingAllGather()(output, part, dist.group.WORLD)
    mean = torch.empty(SHARD)
    RingReduceScatter()(mean, torch.full((SHARD * world,), float(rank)), dist.group.WORLD, dist.ReduceOp.AVG)
    results["fsdp"] = {"gathered": output, "mean": mean}
    leave_world()
    return results


def test_rings_equal_the_backends_collectives() -> None:
    results = run_world(_collectives, 4, timeout=90)
    for rank, result in enumerate(results):
        world = result["world"]
        assert torch.equal(world["gathered"], torch.cat([torch.arange(SHARD) + 10_000 * r for r in range(4)]).float())
        assert torch.equal(world["shard"], world["reference"])
        assert torch.equal(world["shard"], torch.arange(rank * SHARD, (rank + 1) * SHARD).float() * 10)
        assert torch.equal(result["fsdp"]["gathered"], torch.arange(4).repeat_interleave(SHARD).float())
        assert torch.equal(result["fsdp"]["mean"], torch.full((SHARD,), 1.5))
    for rank in (1, 3):
        odd = results[rank]["odd"]
        assert torch.equal(odd["gathered"], torch.cat([torch.arange(SHARD) + 10_000 * r for r in (1, 3)]).float())
        member = (1, 3).index(rank)
        assert torch.equal(odd["shard"], odd["reference"])
        assert torch.equal(odd["shard"], torch.arange(member * SHARD, (member + 1) * SHARD).float() * (2 + 4))
    assert "odd" not in results[0] and "odd" not in results[2]
