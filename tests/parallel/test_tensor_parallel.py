"""Tensor parallel (GPT plan, sequence parallel, automatic plans) and its data-parallel compositions."""

from __future__ import annotations

import pytest
from torch import nn

from meshkit.config import TensorParallelConfig
from meshkit.parallel.tensor.apply import TensorParallelError, check_heads, named_plan
from tests.helpers.distributed import run_world
from tests.helpers.hf_style import TinyDecoder
from tests.helpers.layouts import check, run_layouts
from tests.helpers.training import assert_close_relative, assert_state_close, tiny_gpt

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
    "zero1_tp2": ("gpt", {"tp": 2, "zero_stage": 1}),
    "zero1_tp2_sp": ("gpt", {"tp": 2, "zero_stage": 1, "sequence_parallel": True}),
    "zero2_tp2": ("gpt", {"tp": 2, "zero_stage": 2}),
    "zero2_tp2_sp": ("gpt", {"tp": 2, "zero_stage": 2, "sequence_parallel": True}),
}
# Gradient clipping under ZeRO + TP takes one norm over the dp and tp ranks: it must clip like plain dp × tp.
CLIPPED = {
    "dp2_tp2_clipped": ("gpt", {"tp": 2, "dp_replicate": 2, "max_grad_norm": 0.05}),
    "zero1_tp2_clipped": ("gpt", {"tp": 2, "zero_stage": 1, "max_grad_norm": 0.05}),
    "zero2_tp2_clipped": ("gpt", {"tp": 2, "zero_stage": 2, "max_grad_norm": 0.05}),
}


@pytest.fixture(scope="module")
def hybrid_results() -> list[dict]:
    return run_world(run_layouts, 4, {**HYBRID, **CLIPPED}, timeout=300)


@pytest.mark.parametrize("name", list(HYBRID))
def test_data_parallel_with_tensor_parallel_matches(hybrid_results, name) -> None:
    check(hybrid_results, name, HYBRID[name][0])


@pytest.mark.parametrize("name", ["zero1_tp2_clipped", "zero2_tp2_clipped"])
def test_zero_with_tensor_parallel_clips_like_plain_data_parallel(hybrid_results, name) -> None:
    for rank_results in hybrid_results:
        expected = rank_results["dp2_tp2_clipped"]
        assert_close_relative(rank_results[name]["losses"], expected["losses"], 1e-5)
        assert_state_close(rank_results[name]["state"], expected["state"], 1e-5)
    unclipped = hybrid_results[0]["zero1_tp2"]["losses"]
    assert abs(hybrid_results[0][name]["losses"][-1] - unclipped[-1]) > 1e-4  # the clip really acted


def test_tp_that_does_not_divide_the_heads_names_the_valid_sizes() -> None:
    with pytest.raises(
        TensorParallelError,
        match=r"tp=3 does not divide the attention's head counts \(heads=4, kv_heads=2\): choose tp 1 or 2$",
    ):
        check_heads(tiny_gpt(), 3)


def test_automatic_plan_lists_linear_layers_it_has_no_rule_for() -> None:
    model = TinyDecoder()
    model.layers[0].mlp.extra_proj = nn.Linear(4, 4)
    with pytest.raises(TensorParallelError, match=r"no rule for Linear layers \['layers.0.mlp.extra_proj'\]"):
        named_plan(model, TensorParallelConfig())
    plan = named_plan(model, TensorParallelConfig(plan={"*.extra_proj": "replicate", "*_proj": "colwise"}))
    assert plan["layers.0.mlp.extra_proj"] == "replicate" and plan["layers.1.self_attn.q_proj"] == "colwise"
