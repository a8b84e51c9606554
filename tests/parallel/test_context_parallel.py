"""The GPT with context parallel (ring attention) matches a single process, alone and with FSDP."""

from __future__ import annotations

import pytest
import torch

from meshkit.parallel.context.apply import ContextParallelError, local_positions, shard_sequence
from tests.helpers.distributed import run_world
from tests.helpers.layouts import check, run_layouts

LAYOUTS = {
    2: {"gpt_cp2": ("gpt", {"cp": 2})},
    4: {
        "fsdp2_cp2": ("gpt", {"cp": 2, "zero_stage": 3}),
        "dp2_cp2": ("gpt", {"cp": 2, "dp_replicate": 2}),
        "tp2_cp2": ("gpt", {"cp": 2, "tp": 2}),
    },
}


@pytest.fixture(scope="module", params=[2, 4])
def results(request) -> tuple[int, list[dict]]:
    return request.param, run_world(run_layouts, request.param, LAYOUTS[request.param], timeout=300)


def test_context_parallel_layouts_match_a_single_process(results) -> None:
    world, per_rank = results
    for name, (kind, _) in LAYOUTS[world].items():
        check(per_rank, name, kind)


def test_load_balanced_chunks_and_positions() -> None:
    tokens = torch.arange(16).view(1, 16)
    assert shard_sequence(tokens, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(tokens, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert local_positions(8, 2, 1, torch.device("cpu")).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ContextParallelError, match=r"sequence length 10 is not divisible by 2·cp = 4"):
        shard_sequence(torch.zeros(1, 10), 2, 0)
