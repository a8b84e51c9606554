"""ZeRO-1/2/3, HSDP and CPU offload against DDP at world 4: equivalence and the ZeRO memory formulas."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshkit import Engine
from meshkit.models.gpt import lm_loss
from meshkit.runtime import collectives, ring_collectives
from tests.helpers.distributed import gloo_world, run_world
from tests.helpers.training import assert_close_relative, assert_state_close, split, tiny_gpt, token_batches

STEPS, GLOBAL_BATCH, WORLD = 10, 8, 4
LAYOUTS = {
    "ddp": {"ddp": {"gradient_as_bucket_view": True}},  # gradients are views of DDP's buckets: stored once
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "hsdp": {"zero_stage": 3, "dp_replicate": 2, "dp_shard": 2},
    "zero3_cpu_offload": {"zero_stage": 3, "offload": "cpu"},
    "zero3_kept_gathered": {"zero_stage": 3, "reshard_after_forward": False},  # ZeRO-2-like FSDP schedule
    "zero3_per_block": {"zero_stage": 3, "unit_mb": 0},  # one FSDP unit per block (the tiny blocks share one)
    "zero3_backend_collectives": {"zero_stage": 3, "sharding": {"ring_collectives": False}},  # gloo's own
}
RING_USERS = {"zero1", "zero2", "zero3", "hsdp", "zero3_cpu_offload", "zero3_kept_gathered", "zero3_per_block"}


def train_layout(rank: int, overrides: dict) -> dict:
    calls = {"all_gather": 0, "reduce_scatter": 0}

    def counted(name: str, ring):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return ring(*args, **kwargs)

        return call

    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("always")
        gather = counted("all_gather", ring_collectives.ring_all_gather)
        scatter = counted("reduce_scatter", ring_collectives.ring_reduce_scatter)
        for module in (ring_collectives, collectives):  # FSDP's hooks and ZeRO-1/2's flat collectives
            patch.setattr(module, "ring_all_gather", gather)
            patch.setattr(module, "ring_reduce_scatter", scatter)
        return {**_train_layout(overrides, caught), "ring_calls": calls}


def _train_layout(overrides: dict, caught: list) -> dict:
    engine = Engine(seed=0, **overrides)
    model = tiny_gpt()
    model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    local = GLOBAL_BATCH // engine.dp_size
    losses, report = [], {}
    for step, batch in enumerate(token_batches(STEPS, GLOBAL_BATCH)):
        inputs, targets = split(batch[engine.dp_rank * local : (engine.dp_rank + 1) * local])
        loss = lm_loss(model(inputs), targets)
        engine.backward(loss)
        optimizer.step()
        if step == STEPS - 1:
            report = engine.memory_report()  # params, gradients and optimizer states all held here
        optimizer.zero_grad()
        losses.append(engine.reduce(loss.detach()).item())
    result = {
        "losses": losses,
        "state": engine.full_state_dict(),
        "memory": report,
        "warnings": [str(w.message) for w in caught],
    }
    engine.end()
    return result


def all_layouts(rank: int) -> dict:
    # One process group for all layouts: each Engine joins it (and leaves it in place at end()).
    with gloo_world():
        return {name: train_layout(rank, overrides) for name, overrides in LAYOUTS.items()}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(all_layouts, WORLD, timeout=400)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "ddp"])
def test_sharded_layouts_match_ddp(results, layout) -> None:
    reference = results[0]["ddp"]
    assert reference["losses"][-1] < reference["losses"][0]
    for rank_results in results:
        assert_close_relative(rank_results[layout]["losses"], reference["losses"], 1e-5)
        assert_state_close(rank_results[layout]["state"], reference["state"], 1e-5)


PSI = sum(p.numel() for p in tiny_gpt().parameters())
N = WORLD
FORMULA = {  # fp32 params 4Ψ, fp32 grads 4Ψ, Adam moments 8Ψ
    "ddp": 16 * PSI,
    "zero1": 8 * PSI + 8 * PSI / N,
    "zero2": 4 * PSI + 12 * PSI / N,
    "zero3": 16 * PSI / N,
    "zero3_per_block": 16 * PSI / N,
    "hsdp": 16 * PSI / 2,  # sharded within groups of dp_shard=2
}


@pytest.mark.parametrize("layout", list(FORMULA))
def test_model_state_bytes_follow_the_zero_formulas(results, layout) -> None:
    for rank_results in results:
        memory = rank_results[layout]["memory"]
        held = memory["params"] + memory["grads"] + memory["optimizer"]
        assert abs(held - FORMULA[layout]) <= 0.05 * FORMULA[layout], (layout, memory, FORMULA[layout])
        assert memory["peak_rss"] >= memory["rss"] > 100 * 2**20  # a torch process holds > 100 MiB


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_layouts_gather_and_reduce_in_rings_on_the_host(results, layout) -> None:
    """ZeRO-1/2 gather in a ring (their reduce runs in buckets during backward); ZeRO-3 both gathers and
    reduce-scatters in rings unless `ring_collectives` is off; DDP all-reduces."""
    calls = results[0][layout]["ring_calls"]
    if layout in RING_USERS:
        assert calls["all_gather"] >= STEPS, calls
        if layout.startswith(("zero3", "hsdp")):
            assert calls["reduce_scatter"] >= STEPS, calls
        else:
            assert calls["reduce_scatter"] == 0, calls  # (ZeRO-1/2 reduce bucket by bucket)
    else:
        assert calls == {"all_gather": 0, "reduce_scatter": 0}, calls


def test_cpu_offload_on_a_cpu_host_says_there_is_nothing_to_move(results) -> None:
    assert any("nothing to move" in w for w in results[0]["zero3_cpu_offload"]["warnings"])


@pytest.mark.parametrize("layout", ["zero3", "hsdp"])
def test_sharded_layouts_use_no_deprecated_device_mesh_api(results, layout) -> None:
    deprecated = [w for rank in results for w in rank[layout]["warnings"] if "deprecated" in w.lower()]
    assert deprecated == [], deprecated


def test_blocks_are_grouped_into_units_by_parameter_bytes() -> None:
    from torch import nn

    from meshkit.parallel.fsdp import group_blocks

    blocks = [nn.Linear(250, 1000, bias=False) for _ in range(5)]  # 1 MB of fp32 each
    assert [len(unit) for unit in group_blocks(blocks, 0)] == [1, 1, 1, 1, 1]
    assert [len(unit) for unit in group_blocks(blocks, 2.5)] == [2, 2, 1]
    assert [len(unit) for unit in group_blocks(blocks, 0.5)] == [1, 1, 1, 1, 1]  # a bigger block stays whole
    assert [block for unit in group_blocks(blocks, 3) for block in unit] == blocks  # in order, each once
