"""The estimator reads mixture-of-experts configs: total parameters (every expert), the experts' share, and the
active parameters a token passes through — checked against the tiny models' own parameter counts."""

from __future__ import annotations

import pytest

from meshkit.planning.estimate import ModelShape
from meshkit.planning.perf_model import flops_per_token
from tests.helpers.moe_models import EXPERTS, MOE_FAMILIES, TOP_K, moe_causal_lm


def _shape(tmp_path, model) -> ModelShape:
    path = tmp_path / "config.json"
    model.config.to_json_file(path)
    return ModelShape.from_hf_config(path)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_total_expert_and_active_parameters_match_the_model(tmp_path, family: str) -> None:
    model = moe_causal_lm(family)
    shape = _shape(tmp_path, model)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)  # the fused expert banks
    assert shape.expert_params == experts
    if family != "deepseek_v3":  # (its latent attention is counted as plain attention: the experts are exact)
        assert shape.params == pytest.approx(total, rel=0.01)
    assert shape.active_params == pytest.approx(shape.params - experts * (1 - TOP_K / EXPERTS))
    assert shape.active_expert_fraction == TOP_K / EXPERTS


def test_compute_follows_the_active_parameters_and_memory_all_of_them(tmp_path) -> None:
    shape = _shape(tmp_path, moe_causal_lm("mixtral"))
    dense = ModelShape(**{**shape.__dict__, "expert_params": 0.0, "active_expert_fraction": 1.0})
    block_flops, _, _ = flops_per_token(shape, 64)
    dense_flops, _, _ = flops_per_token(dense, 64)
    assert dense_flops - block_flops == pytest.approx(6 * shape.expert_params * (1 - TOP_K / EXPERTS))
    assert shape.params == dense.params  # model states hold every expert


def test_meshkit_estimate_names_total_and_active_parameters(tmp_path) -> None:
    from typer.testing import CliRunner

    from meshkit.cli.main import app

    model = moe_causal_lm("mixtral")
    model.config.to_json_file(tmp_path / "config.json")
    result = CliRunner().invoke(app, ["estimate", str(tmp_path / "config.json")])
    assert result.exit_code == 0, result.output
    assert "mixture of experts:" in result.output and "active per token (50% of the" in result.output
