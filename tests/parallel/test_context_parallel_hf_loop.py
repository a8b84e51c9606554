"""Context parallel under the loop users already have: `model(**engine.shard_sequence(batch)).loss` with labels
in the batch. The labels are shifted on the whole sequence and each cp rank's loss weighted by the whole's token
count, so the loop trains like one process — also when padding (-100) leaves the chunks unequal counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshkit import Engine
from meshkit.parallel.context.apply import ContextParallelError
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.hf_layouts import GLOBAL_BATCH, batches, make_optimizer, one_process
from tests.helpers.hf_models import causal_lm
from tests.helpers.training import assert_close_relative, assert_state_close


def _batches(padded: bool) -> list[dict[str, torch.Tensor]]:
    out = batches()
    if padded:  # rows end in 0..5 padded positions: the second cp chunk of a row holds fewer targets
        for batch in out:
            for row in range(GLOBAL_BATCH):
                if row % 3:
                    batch["labels"][row, -(row + 2) :] = -100
    return out


def _reference(family: str, padded: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = causal_lm(family)
    return one_process(model, make_optimizer(model), _batches(padded))


def _loop(rank: int, family: str, overrides: dict, padded: bool) -> dict:
    dist.init_process_group("gloo")
    engine = Engine(seed=0, **overrides)
    model = causal_lm(family)
    model, optimizer = engine.prepare(model, make_optimizer(model))
    local = GLOBAL_BATCH // engine.dp_size
    losses = []
    for batch in _batches(padded):
        part = {k: v[engine.dp_rank * local : (engine.dp_rank + 1) * local] for k, v in batch.items()}
        loss = model(**engine.shard_sequence(part)).loss
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(engine.reduce(loss.detach(), op="mean").item())
    refused = ""
    try:
        model(**part)  # the whole sequence with labels: the model would shift inside each chunk
    except ContextParallelError as err:
        refused = str(err)
    out = {"losses": losses, "state": engine.full_state_dict(), "refused": refused}
    engine.end()
    leave_world()
    return out


@pytest.mark.parametrize(
    ("family", "world", "overrides", "padded"),
    [
        ("llama", 2, {"cp": 2}, True),
        ("qwen3", 2, {"cp": 2}, True),
        ("llama", 4, {"cp": 2, "dp_replicate": 2}, False),
    ],
)
def test_a_plain_hf_loop_under_context_parallel_trains_like_one_process(family, world, overrides, padded) -> None:
    losses, state = _reference(family, padded)
    for rank, got in enumerate(run_world(_loop, world, family, overrides, padded, timeout=300)):
        assert_close_relative(got["losses"], losses, 1e-5)
        assert_state_close(got["state"], state, 1e-5)
        assert "engine.shard_sequence(batch)" in got["refused"] and "\n" not in got["refused"], rank
