"""The flat all-gather ZeRO-1/2 use after their step: gathered in pieces through a small staging buffer on gloo,
it fills the output exactly as one whole gather does."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshkit.runtime.collectives import all_gather_flat
from tests.helpers.distributed import leave_world, run_world

SHARD = 1000  # elements per rank; pieces of 384 bytes = 96 fp32 elements: 11 pieces, the last one short


def _gather(rank: int) -> dict:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    whole = torch.zeros(SHARD * world)
    pieces = torch.zeros(SHARD * world)
    for output in (whole, pieces):
        output[rank * SHARD : (rank + 1) * SHARD] = torch.arange(SHARD) + 10_000 * rank
    all_gather_flat(whole, whole[rank * SHARD : (rank + 1) * SHARD], None)
    all_gather_flat(pieces, pieces[rank * SHARD : (rank + 1) * SHARD], None, piece_bytes=384)
    leave_world()
    return {"whole": whole, "pieces": pieces}


def test_a_gather_in_pieces_equals_the_whole_gather() -> None:
    for result in run_world(_gather, 3, timeout=60):
        expected = torch.cat([torch.arange(SHARD) + 10_000 * rank for rank in range(3)]).float()
        assert torch.equal(result["whole"], expected)
        assert torch.equal(result["pieces"], expected)
