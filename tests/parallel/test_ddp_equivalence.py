"""DDP at world 2 and 4 matches a single-process run of the same global batch (fp32, <= 1e-5 relative)."""

from __future__ import annotations

import pytest

from meshkit import Engine
from meshkit.models.gpt import lm_loss
from tests.helpers.distributed import run_world
from tests.helpers.training import (
    assert_close_relative,
    assert_state_close,
    make_optimizer,
    reference_run,
    split,
    tiny_gpt,
    token_batches,
)

STEPS, GLOBAL_BATCH = 6, 8


def ddp_rank(rank: int, world: int, loop: str, kind: str) -> tuple[list[float], dict]:
    engine = Engine(seed=0, logging={"dir": "/tmp/meshkit-test-runs"})
    model = tiny_gpt()
    model, optimizer = engine.prepare(model, make_optimizer(model, kind), loss_fn=lm_loss)
    local = GLOBAL_BATCH // world
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        inputs, targets = split(batch[rank * local : (rank + 1) * local])
        if loop == "train_step":
            loss = engine.train_step((inputs, targets))
        else:
            loss = lm_loss(model(inputs), targets)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(engine.reduce(loss.detach()).item())
    state = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    engine.end()
    return losses, state


@pytest.mark.parametrize(("world", "loop"), [(2, "backward"), (4, "train_step")])
def test_ddp_matches_single_process(world: int, loop: str) -> None:
    expected_losses, expected_state = reference_run(token_batches(STEPS, GLOBAL_BATCH))
    results = run_world(ddp_rank, world, world, loop, "sgd", timeout=180)
    for losses, state in results:
        assert_close_relative(losses, expected_losses, 1e-5)
        assert_state_close(state, expected_state, 1e-5)
    assert expected_losses[-1] < 0.8 * expected_losses[0]  # it trained


def test_ddp_with_adamw_matches_single_process() -> None:
    expected_losses, expected_state = reference_run(token_batches(STEPS, GLOBAL_BATCH), "adamw")
    results = run_world(ddp_rank, 2, 2, "backward", "adamw", timeout=180)
    for losses, state in results:
        assert_close_relative(losses, expected_losses, 1e-5)
        assert_state_close(state, expected_state, 1e-4)  # see make_optimizer: Adam magnifies rounding
