"""Tensor parallel (GPT plan, sequence parallel, automatic plans) and its data-parallel compositions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshkit.config import TensorParallelConfig
from meshkit.models.layer_roles import LayerRoles, layer_roles
from meshkit.models.structure import describe
from meshkit.parallel.tensor.apply import TensorParallelError, check_heads
from meshkit.parallel.tensor.auto import tensor_plan
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
    # every layer name points the wrong way (tests/helpers/misnamed.py): the facts place them
    "misnamed_tp2": ("misnamed", {"tp": 2}),
    "misnamed_tp2_sp": ("misnamed", {"tp": 2, "sequence_parallel": True}),
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
    "misnamed_pp2_tp2_sp": ("misnamed", {"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "1f1b"}),
    "misnamed_fsdp2_tp2": ("misnamed", {"tp": 2, "zero_stage": 3}),
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


def test_the_plan_comes_from_the_traced_forward_and_a_layer_it_never_runs_stays_whole() -> None:
    model = TinyDecoder()
    model.layers[0].mlp.extra_proj = nn.Linear(4, 4)  # (never called by the MLP's forward)
    roles = layer_roles(model, describe(model))
    plan = tensor_plan(model, TensorParallelConfig(), roles).kinds
    assert plan["layers.0.mlp.extra_proj"] == "replicate" and plan["lm_head"] == "replicate"
    assert plan["layers.0.mlp.gate_proj"] == "colwise" and plan["layers.0.mlp.down_proj"] == "rowwise"
    assert plan["layers.1.self_attn.q_proj"] == "colwise" and plan["layers.1.self_attn.o_proj"] == "rowwise"
    assert {role.source for role in roles.layers.values()} == {"traced"}
    plan = tensor_plan(model, TensorParallelConfig(plan={"*.extra_proj": "replicate", "*_proj": "colwise"}), roles)
    assert plan.kinds["layers.0.mlp.extra_proj"] == "replicate" and plan.kinds["layers.1.self_attn.o_proj"] == "colwise"


def test_where_the_forward_cannot_be_traced_names_decide_and_say_so() -> None:
    model = TinyDecoder()
    unplaced = tuple(name for name, _ in model.named_modules() if name.endswith("_proj"))
    roles = LayerRoles(unplaced=unplaced, trace_error="RuntimeError: no")
    plan = tensor_plan(model, TensorParallelConfig(), roles)
    assert plan.kinds["layers.0.self_attn.q_proj"] == "colwise" and plan.kinds["layers.0.mlp.down_proj"] == "rowwise"
    assert plan.note is not None and "by their names" in plan.note and "(RuntimeError: no)" in plan.note
    model.layers[0].mlp.extra_proj = nn.Linear(4, 4)
    roles = LayerRoles(unplaced=(*unplaced, "layers.0.mlp.extra_proj"), trace_error="RuntimeError: no")
    with pytest.raises(TensorParallelError, match=r"could not trace TinyDecoder's forward \(RuntimeError: no\) and "
                       r"has no name rule for its layers \['layers.0.mlp.extra_proj'\]"):  # fmt: skip
        tensor_plan(model, TensorParallelConfig(), roles)


def _whole_gradients(rank: int, differ: bool) -> str:
    import torch.distributed as dist

    from meshkit.parallel.tensor.consistency import WholeGradientsAgree

    dist.init_process_group("gloo")
    same, other = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    same.grad, other.grad = torch.full((3,), 0.5), torch.full((2,), 1.0 + (rank if differ else 0))
    check = WholeGradientsAgree([("layers.0.norm.weight", same), ("layers.0.bias", other)], dist.group.WORLD)
    try:
        check.reduce_gradients()
        check.reduce_gradients()  # (once: the second window is not compared)
        return "agree"
    except TensorParallelError as error:
        return str(error)
    finally:
        dist.destroy_process_group()


def test_whole_gradients_that_differ_over_tp_stop_the_first_step() -> None:
    assert run_world(_whole_gradients, 2, False, timeout=60) == ["agree", "agree"]
    refused = run_world(_whole_gradients, 2, True, timeout=60)
    assert refused[0] == refused[1] and refused[0].startswith(
        "tensor parallel: the gradient of layers.0.bias (whole on every tp rank) differs between the tp ranks"
    )


def test_sequence_parallel_reaches_the_norms_of_a_container() -> None:
    """A block child that is a list of norms (LongCat-Flash's two input norms) is not called itself: each norm in
    it runs on the sequence shards, named by its own path."""
    from meshkit.parallel.tensor.sequence import _owners

    norms = torch.nn.ModuleList([torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)])
    assert [(path, type(module).__name__) for path, module in _owners(norms, "layers.0.norms")] == [
        ("layers.0.norms.0", "LayerNorm"),
        ("layers.0.norms.1", "LayerNorm"),
    ]
    single = torch.nn.LayerNorm(4)
    assert _owners(single, "layers.0.norm") == [("layers.0.norm", single)]
