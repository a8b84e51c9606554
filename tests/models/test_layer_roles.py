"""Layer roles for tensor parallel from the model's declaration or a traced forward, and the parameters a forward
leaves without a gradient: facts, not names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshkit.models.layer_roles import layer_roles
from meshkit.models.structure import describe
from meshkit.models.usage import parameters_without_gradient

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_models import causal_lm  # noqa: E402


def _roles(family: str, block: str = "0") -> dict[str, tuple[str, str, str | None]]:
    model = causal_lm(family)
    roles = layer_roles(model, describe(model))
    marker = f".{block}."
    return {name.split(marker, 1)[1]: (r.role, r.source, r.fused) for name, r in roles.layers.items() if marker in name}


def test_a_declared_plan_decides_and_its_gathers_become_meshkits_own_splits() -> None:
    llama = _roles("llama")
    assert llama["self_attn.q_proj"] == ("column", "declared", None)
    assert llama["mlp.down_proj"] == ("row", "declared", None)
    phi3 = _roles("phi3")  # colwise_gather_output on fused layers: regrouped per rank instead of gathered
    assert phi3["self_attn.qkv_proj"] == ("column", "declared", "qkv")
    assert phi3["mlp.gate_up_proj"] == ("column", "declared", "gate_up")
    assert phi3["self_attn.o_proj"] == ("row", "declared", None)
    olmo2 = _roles("olmo2")  # gathered for its whole-projection norms, which meshkit splits with the heads
    assert olmo2["self_attn.k_proj"] == ("column", "declared", None)


def test_without_a_declaration_the_trace_finds_readers_writers_and_how_fused_outputs_are_cut() -> None:
    gpt2 = _roles("gpt2")  # c_attn split into q, k, v one after the other: regrouped
    assert gpt2["attn.c_attn"] == ("column", "traced", "qkv") and gpt2["attn.c_proj"] == ("row", "traced", None)
    assert gpt2["mlp.c_fc"] == ("column", "traced", None) and gpt2["mlp.c_proj"] == ("row", "traced", None)
    bloom = _roles("bloom")  # query_key_value viewed per head first: a plain column split gives whole heads
    assert bloom["self_attention.query_key_value"] == ("column", "traced", None)
    opt = _roles("opt")  # fc1/fc2 are the block's own children
    assert opt["fc1"] == ("column", "traced", None) and opt["fc2"] == ("row", "traced", None)


def test_a_region_the_trace_cannot_prove_stays_whole() -> None:
    model = causal_lm("stablelm")
    mlp = model.model.layers[0].mlp
    down = mlp.down_proj

    def forward(x: torch.Tensor) -> torch.Tensor:  # a norm between the layers mixes the split features
        hidden = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        return down(hidden / hidden.norm(dim=-1, keepdim=True))

    mlp.forward = forward
    roles = layer_roles(model, describe(model))
    assert roles.layers["model.layers.0.mlp.gate_proj"].role == "whole"
    assert "mixes features" in roles.whole_regions["model.layers.0.mlp"]
    assert roles.layers["model.layers.1.mlp.gate_proj"].role == "column"


def test_parameters_a_forward_never_reaches_are_found() -> None:
    model = causal_lm("llama")
    model.model.layers[0].self_attn.unused = nn.Linear(4, 4)  # (never called)
    found = parameters_without_gradient(model, describe(model))
    assert found == ("model.layers.0.self_attn.unused.weight", "model.layers.0.self_attn.unused.bias")
    model.model.layers[0].self_attn.unused.requires_grad_(False)
    assert parameters_without_gradient(model, describe(model)) == ()
