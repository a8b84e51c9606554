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


def sharded_compiled_rank(rank: int, regional: bool | None) -> tuple[list[float], int, int, str]:
    """ZeRO-3 (FSDP2) at world 2 with compile on: losses, dynamo's graphs and graph breaks, how it compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with Engine(zero_stage=3, compile={"enabled": True, "backend": "aot_eager", "regional": regional}) as engine:
        model = tiny_gpt()
        model, _ = engine.prepare(model, make_optimizer(model), loss_fn=lm_loss)
        losses = [
            engine.reduce(engine.train_step(split(batch[rank * 2 : (rank + 1) * 2]))).item()
            for batch in token_batches(3, 4)
        ]
        how = engine.ctx.objects.compiled
    return losses, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), how


def test_compile_under_zero3_is_per_block_by_default_in_one_graph() -> None:
    """Sharding hooks sit in the model: compile means each block, compiled before FSDP2 wraps it — one graph
    for every block, no break, the eager losses."""
    eager = losses_with(enabled=False)
    for losses, graphs, breaks, how in run_world(sharded_compiled_rank, 2, None, timeout=300):
        assert how == "per block (2 blocks)" and (graphs, breaks) == (1, 0)
        assert_close_relative(losses, eager, 1e-5)


def test_whole_model_compile_is_what_ddp_and_one_process_keep_and_what_regional_false_asks() -> None:
    with Engine(compile={"enabled": True, "backend": "aot_eager"}) as engine:
        model = tiny_gpt()
        engine.prepare(model, make_optimizer(model), loss_fn=lm_loss)
        assert engine.ctx.objects.compiled == "whole model"


def measured_compiled_rank(rank: int, run_dir: str) -> tuple[dict, int]:
    from torch._dynamo.utils import counters

    from meshkit.recipes.train import resolve_recipe, train
    from tests.cli.test_cli import SMALL

    torch._dynamo.reset()
    counters.clear()
    overrides = ["zero_stage=3", "compile.enabled=true", "compile.backend=aot_eager", "compile.regional=false"]
    summary = train(resolve_recipe(None, [*SMALL, *overrides, f"logging.dir={run_dir}"]))
    return summary, sum(counters["graph_break"].values())


def test_the_first_steps_activation_measurement_is_never_compiled(tmp_path) -> None:
    """meshkit train measures the first micro-step's saved tensors through saved-tensor hooks; a compiled model
    calls them from inside its graph, and dynamo must not trace them (under ZeRO-3 it broke the graph there and
    crashed on a view's missing base)."""
    for summary, breaks in run_world(measured_compiled_rank, 2, str(tmp_path), timeout=300):
        assert summary["compile"] == "whole model" and summary["activations"][0]["saved_bytes"] > 0
        assert breaks == 0
