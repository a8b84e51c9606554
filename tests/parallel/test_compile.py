"""torch.compile (whole model and regional) gives the losses of eager mode, alone and under DDP."""

from __future__ import annotations

import pytest
import torch

from meshkit import Engine
from meshkit.models.gpt import lm_loss
from tests.helpers.distributed import run_world
from tests.helpers.training import assert_close_relative, make_optimizer, split, tiny_gpt, token_batches


def losses_with(steps: int = 3, rank: int = 0, world: int = 1, **compile_cfg) -> list[float]:
    with Engine(compile=compile_cfg) as engine:
        model = tiny_gpt()
        model, _ = engine.prepare(model, make_optimizer(model), loss_fn=lm_loss)
        local = 4 // world
        out = []
        for batch in token_batches(steps, 4):
            out.append(engine.reduce(engine.train_step(split(batch[rank * local : (rank + 1) * local]))).item())
        if compile_cfg.get("enabled"):
            compiled = engine.unwrap_model().layers[0] if compile_cfg.get("regional") else engine.unwrap_model()
            assert compiled._compiled_call_impl is not None  # really compiled, in place
        return out


@pytest.mark.parametrize("regional", [False, True])
def test_compiled_losses_equal_eager(regional: bool) -> None:
    torch._dynamo.reset()
    eager = losses_with(enabled=False)
    compiled = losses_with(enabled=True, backend="aot_eager", regional=regional)
    assert_close_relative(compiled, eager, 1e-5)


def compiled_ddp_rank(rank: int) -> list[float]:
    return losses_with(rank=rank, world=2, enabled=True, backend="aot_eager", regional=True)


def test_regional_compile_under_ddp() -> None:
    eager = losses_with(enabled=False)
    for losses in run_world(compiled_ddp_rank, 2, timeout=240):
        assert_close_relative(losses, eager, 1e-5)
