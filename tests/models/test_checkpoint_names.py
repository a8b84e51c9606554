"""A checkpoint in the hub's layout (one tensor per expert: `block_sparse_moe.experts.3.w1.weight`) loads into
transformers 5's fused expert banks through meshkit's streaming loader exactly as from_pretrained loads it; a model
built on the meta device and streamed computes what from_pretrained's does."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from meshkit.models.facts import tied_parameters
from meshkit.parallel.materialize import MaterializeError, materialize
from tests.helpers.hf_models import FAMILIES, causal_lm, config
from tests.helpers.moe_models import moe_causal_lm, moe_config, save_mxfp4_gpt_oss, transformers


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_per_expert_checkpoint_streams_into_fused_banks_as_from_pretrained_loads_it(tmp_path, family: str) -> None:
    moe_causal_lm(family, seed=3).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        stored = list(handle.keys())
    assert any(".experts.3." in key for key in stored) and not any("gate_up_proj" in key for key in stored)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(moe_config(family), dtype=torch.float32)
    materialize(model, torch.device("cpu"), tmp_path / "model.safetensors")
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_checkpoint_of_another_model_is_still_one_line(tmp_path) -> None:
    moe_causal_lm("mixtral").save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(moe_config("qwen3_moe"), dtype=torch.float32)
    with pytest.raises(MaterializeError, match="does not match the model: missing .* unexpected"):
        materialize(model, torch.device("cpu"), tmp_path / "model.safetensors")


@pytest.mark.parametrize("family", [*FAMILIES, "gemma3_vision"])
def test_a_model_streamed_from_meta_computes_what_from_pretrained_loads(tmp_path, family: str) -> None:
    """Weights, and the buffers no checkpoint holds (rotary tables; Gemma 3's embedding scale, a buffer beside the
    embedding's weight); Gemma 3 as published also keeps its tied head in the checkpoint's older names."""
    causal_lm(family, seed=3).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(family), dtype=torch.float32)
    aliases = {alias: group[0] for group in tied_parameters(model) for alias in group[1:]}
    materialize(model, torch.device("cpu"), tmp_path / "model.safetensors", aliases=aliases)
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected(input_ids=ids).logits, rtol=0, atol=0)


def test_an_mxfp4_checkpoint_streams_dequantized_as_from_pretrained_loads_it(tmp_path) -> None:
    """gpt-oss as released: each expert bank as packed 4-bit values (`_blocks`) and one exponent per 32 of them
    (`_scales`); transformers dequantizes it with Mxfp4Config(dequantize=True), meshkit as it streams."""
    banks = save_mxfp4_gpt_oss(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(moe_config("gpt_oss"), dtype=torch.float32)
    materialize(model, torch.device("cpu"), tmp_path / "model.safetensors")
    expected = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert got[banks[0]].abs().max() > 0  # the values, not zeros
