"""A fused projection the model cuts into a fixed number of groups before its parts (CodeGen: q, v and k inside
each of 4 groups, whatever the head count) trains under tensor parallel as in one process: each rank keeps the 4
groups with its share of their heads. Where a group's heads cannot be shared (4 groups of 1 head, tp 2) the first
step stops in one line."""

from __future__ import annotations

import pytest
import torch

from meshkit.parallel.tensor.storage import FusedParts
from tests.helpers.distributed import gloo_world, run_world
from tests.helpers.hf_layouts import make_optimizer, reference, train_in_layout
from tests.helpers.hf_models import causal_lm
from tests.helpers.training import assert_close_relative, assert_state_close

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


def test_grouped_rows_give_each_rank_its_heads_in_every_group() -> None:
    """4 groups × [q | v | k] of 2 heads of size 1 (rows named by group, part, head): rank 0 keeps heads 0-3, i.e.
    groups 0 and 1 (their two heads), laid out as 4 groups of one head each; the inverse restores the file order."""
    layout = FusedParts(0, (8, 8, 8), groups=4, unit=1)
    rows = torch.arange(24)
    stored = layout.interleave(rows, 2)
    # (row = group·6 + part·2 + head; rank 0's local group j holds global head j: group j // 2, head j % 2)
    assert stored[:12].tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]
    assert stored[12:].tolist() == [12, 14, 16, 13, 15, 17, 18, 20, 22, 19, 21, 23]
    assert torch.equal(layout.restore(stored, 2), rows)
    plain = FusedParts(0, (4, 4, 4))  # (one group: the interleave every fused q/k/v gets)
    assert torch.equal(FusedParts(0, (4, 4, 4), groups=1).interleave(rows[:12], 2), plain.interleave(rows[:12], 2))


def _codegen(rank: int, heads: int) -> dict:
    def builder(_: str) -> torch.nn.Module:
        return causal_lm("codegen", n_head=heads)

    with gloo_world():
        return train_in_layout("codegen", {"tp": 2}, builder, make_optimizer)


@pytest.mark.world
def test_codegen_trains_under_tensor_parallel_as_one_process() -> None:
    losses, state = reference("codegen")
    for result in run_world(_codegen, 2, 8, timeout=240):
        assert "refused" not in result, result.get("refused")
        assert_close_relative(result["losses"], losses, 1e-5)
        assert_state_close(result["state"], state, 1e-5)


@pytest.mark.world
def test_groups_of_one_head_are_refused_at_the_first_step() -> None:
    for result in run_world(_codegen, 2, 4, timeout=240):
        assert "cuts its output into 4 groups on this rank where 2 were expected" in result["refused"]
