"""Pipeline parallel with every schedule, and its compositions, against a single process."""

from __future__ import annotations

import pytest

from meshkit.parallel.pipeline.stages import SCHEDULE_CLASSES, PipelineError, balanced_split
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.layouts import check, run_layouts

PP2 = {f"pp2_{name}": ("gpt4", {"pp": 2, "schedule": name}) for name in SCHEDULE_CLASSES}


@pytest.fixture(scope="module")
def pp2_results() -> list[dict]:
    return run_world(run_layouts, 2, PP2, timeout=400)


@pytest.mark.parametrize("name", list(PP2))
def test_each_schedule_at_pp2_matches_a_single_process(pp2_results, name) -> None:
    check(pp2_results, name, "gpt4")


WORLD4 = {
    "pp4_gpipe": ("gpt4", {"pp": 4, "schedule": "gpipe", "microbatches": 4}),
    "pp4_1f1b": ("gpt4", {"pp": 4, "schedule": "1f1b", "microbatches": 4}),
    "pp2_dp2": ("gpt4", {"pp": 2, "dp_replicate": 2}),
    "pp2_fsdp2": ("gpt4", {"pp": 2, "zero_stage": 3}),
}


@pytest.fixture(scope="module")
def world4_results() -> list[dict]:
    return run_world(run_layouts, 4, WORLD4, timeout=400)


@pytest.mark.parametrize("name", list(WORLD4))
def test_pipeline_compositions_at_world_4(world4_results, name) -> None:
    check(world4_results, name, "gpt4")


def test_pp2_dp2_tp2_at_world_8(world8) -> None:
    check([rank_results["layouts"] for rank_results in world8], "pp2_dp2_tp2", "gpt4")


def test_balanced_split_by_parameter_count() -> None:
    # the first stage also carries a large embedding, so it gets fewer blocks
    assert balanced_split([10, 10, 10, 10], 2, 25, 0) == [range(0, 1), range(1, 4)]
    assert balanced_split([10, 10, 10, 10], 4, 0, 0) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(PipelineError, match="6 pipeline stages .* need at least 6 blocks, the model has 4"):
        balanced_split([1, 1, 1, 1], 6, 0, 0)


def bad_microbatches_rank(rank: int) -> list[str]:
    import torch

    from meshkit import Engine
    from meshkit.models.gpt import lm_loss
    from tests.helpers.layouts import tiny_gpt_4_blocks
    from tests.helpers.training import split, token_batches

    torch.distributed.init_process_group("gloo")
    messages = []
    try:
        Engine(pp=2, microbatches=1).prepare(tiny_gpt_4_blocks(), loss_fn=lm_loss)
    except ValueError as err:
        messages.append(str(err))
    engine = Engine(pp=2, microbatches=2)
    model = engine.prepare(tiny_gpt_4_blocks(), loss_fn=lm_loss)
    engine.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        engine.train_step(split(token_batches(1, 3)[0]))
    except ValueError as err:
        messages.append(str(err))
    leave_world()
    return messages


def test_microbatch_settings_that_cannot_run_are_one_line_errors() -> None:
    for messages in run_world(bad_microbatches_rank, 2, timeout=120):
        assert messages == [
            "pipeline.microbatches=1 must be at least pp=2",
            "the local batch of 3 does not split into pipeline.microbatches=2: make the per-rank batch size a "
            "multiple of it",
        ]
