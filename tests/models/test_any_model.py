"""Models with no names to go by (`nn.Sequential`) and tied weights, in sharded, pipelined and resumed runs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_world
from tests.helpers.hf_models import config, transformers
from tests.helpers.sequential_runs import run_stack, run_tied, stack_reference
from tests.helpers.training import assert_close_relative, assert_state_close


def test_a_sequential_stack_under_zero3_shards_each_linear_layer() -> None:
    results = run_world(run_stack, 2, {"zero_stage": 3}, timeout=120)
    losses, state = stack_reference()
    for got in results:
        assert_close_relative(got["losses"], losses, 1e-5)
        assert_state_close(got["state"], state, 1e-5)
        assert got["units"] == ["", "0", "2", "4", "6"]  # the root and every Linear (activations hold nothing)
        assert got["held"] * 2 == got["total"]  # each rank holds exactly half of the parameter bytes


def test_a_sequential_stack_runs_as_a_four_stage_pipeline() -> None:
    results = run_world(run_stack, 4, {"pp": 4, "schedule": "1f1b"}, timeout=120)
    losses, state = stack_reference()
    for got in results:
        assert_close_relative(got["losses"], losses, 1e-5)
        assert_state_close(got["state"], state, 1e-5)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_tied_weights_under_zero3_save_once_and_resume_bit_exactly(tmp_path, asynchronous: bool) -> None:
    results = run_world(run_tied, 2, {"zero_stage": 3}, str(tmp_path), asynchronous, timeout=180)
    for got in results:
        assert got["first"] == got["second"]
        for name, tensor in got["first_state"].items():
            assert torch.equal(tensor, got["second_state"][name]), name


def test_tied_weights_across_pipeline_stages_stay_equal_resume_and_export(tmp_path) -> None:
    results = run_world(run_tied, 2, {"pp": 2, "schedule": "1f1b"}, str(tmp_path), False, timeout=180)
    for got in results:  # run_tied asserts after every step that embedding and head are still equal
        assert got["first"] == got["second"]
    config("gpt2").save_pretrained(tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.lm_head.weight is exported.transformer.wte.weight
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, results[0]["first_state"][name]), name
