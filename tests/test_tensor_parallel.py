"""Tensor parallel (GPT plan, sequence parallel, automatic plans) and its data-parallel compositions."""

from __future__ import annotations

import pytest
from torch import nn

from meshkit.config import TensorParallelConfig
from meshkit.parallel.tensor import TensorParallelError, check_heads, named_plan
from tests.distributed import run_world
from tests.hf_style import TinyDecoder
from tests.layouts import check, run_layouts
from tests.training import tiny_gpt

TP2 = {
    "gpt_tp2": ("gpt", {"tp": 2}),
    "gpt_tp2_sp": ("gpt", {"tp": 2, "sequence_parallel": True}),
    "gpt_tp2_gathered_logits": ("gpt", {"tp": 2, "loss_parallel": False}),
    "hf_auto_tp2": ("hf", {"tp": 2}),
    "gpt2_fused_qkv_tp2": ("gpt2", {"tp": 2}),
}


@pytest.fixture(scope="module")
def tp2_results() -> list[dict]:
    return run_world(run_layouts, 2, TP2, timeout=300)


@pytest.mark.parametrize("name", list(TP2))
def test_tensor_parallel_matches_a_single_process(tp2_results, name) -> None:
    check(tp2_results, name, TP2[name][0])


HYBRID = {
    "dp2_tp2": ("gpt", {"tp": 2, "dp_replicate": 2}),
    "fsdp2_tp2_sp": ("gpt", {"tp": 2, "zero_stage": 3, "sequence_parallel": True}),
}


@pytest.fixture(scope="module")
def hybrid_results() -> list[dict]:
    return run_world(run_layouts, 4, HYBRID, timeout=300)


@pytest.mark.parametrize("name", list(HYBRID))
def test_data_parallel_with_tensor_parallel_matches(hybrid_results, name) -> None:
    check(hybrid_results, name, HYBRID[name][0])


def test_tp_that_does_not_divide_the_heads_names_the_valid_sizes() -> None:
    with pytest.raises(TensorParallelError, match=r"tp=3 does not divide n_heads=4: choose tp from 1, 2, 4"):
        check_heads(tiny_gpt(), 3)


def test_automatic_plan_lists_linear_layers_it_has_no_rule_for() -> None:
    model = TinyDecoder()
    model.layers[0].mlp.extra_proj = nn.Linear(4, 4)
    with pytest.raises(TensorParallelError, match=r"no rule for Linear layers \['layers.0.mlp.extra_proj'\]"):
        named_plan(model, TensorParallelConfig())
    plan = named_plan(model, TensorParallelConfig(plan={"*.extra_proj": "replicate", "*_proj": "colwise"}))
    assert plan["layers.0.mlp.extra_proj"] == "replicate" and plan["layers.1.self_attn.q_proj"] == "colwise"
