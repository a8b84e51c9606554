"""The memory estimator against the ZeRO paper's model-state example and hand-computed activation cases."""

from __future__ import annotations

import json

import pytest

from meshkit.planning.estimate import EstimateError, ModelShape, estimate_memory, layer_activation_bytes
from meshkit.planning.step_recipe import StepRecipe
from tests.helpers.cli import meshkit_here as meshkit

PAPER = ModelShape(params=7.5e9)  # ZeRO paper, Figure 1: Ψ = 7.5B, Nd = 64, mixed precision Adam (K = 12)


@pytest.mark.parametrize(("stage", "expected_gb"), [(0, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)])
def test_model_states_reproduce_the_zero_paper(stage: int, expected_gb: float) -> None:
    master = StepRecipe(weights="master")  # the paper's: 16-bit weights, an fp32 master copy in the optimizer
    estimate = estimate_memory(PAPER, zero_stage=stage, dp=64, precision="bf16", optimizer="adam", recipe=master)
    states = estimate.as_json()
    assert states["params_gb"] + states["grads_gb"] + states["optimizer_gb"] == pytest.approx(expected_gb)
    assert "autocast copies_gb" not in states


@pytest.mark.parametrize(("stage", "expected_gb"), [(0, 120.0), (1, 60.9375), (2, 31.40625), (3, 1.875)])
def test_meshkit_keeps_fp32_weights_and_gradients_and_autocast_copies_under_bf16(stage, expected_gb) -> None:
    """The Engine's bf16: fp32 weights and gradients (4 + 4), Adam's moments (8), and below ZeRO-3 the bf16
    copies autocast keeps for backward (2); ZeRO-3 (FSDP2's mixed precision) gathers bf16 layers instead."""
    states = estimate_memory(PAPER, zero_stage=stage, dp=64, precision="bf16", optimizer="adam").as_json()
    assert states["params_gb"] + states["grads_gb"] + states["optimizer_gb"] == pytest.approx(expected_gb)
    assert states.get("autocast copies_gb", 0.0) == pytest.approx(0.0 if stage == 3 else 2 * 7.5)


def test_fp32_adam_is_4_4_8_bytes_per_parameter_and_offload_moves_the_optimizer_off_device() -> None:
    out = estimate_memory(ModelShape(params=1e9), precision="fp32").as_json()
    assert (out["params_gb"], out["grads_gb"], out["optimizer_gb"]) == pytest.approx((4.0, 4.0, 8.0))
    offloaded = estimate_memory(ModelShape(params=1e9), precision="fp32", offload="cpu").as_json()
    assert offloaded["optimizer_gb"] == 0.0 and "offloaded to cpu" in offloaded["formulas"]["optimizer"]


def test_8bit_adam_keeps_2_bytes_of_state_per_parameter_and_the_cli_takes_it() -> None:
    out = estimate_memory(ModelShape(params=1e9), precision="fp32", optimizer="adam8bit").as_json()
    assert out["optimizer_gb"] == pytest.approx(2.0)
    mixed = estimate_memory(ModelShape(params=1e9), precision="bf16", optimizer="adam8bit").as_json()
    assert mixed["optimizer_gb"] == pytest.approx(2.0)  # the Engine's weights are fp32 already: the moments only
    master = StepRecipe(weights="master")
    assert estimate_memory(ModelShape(params=1e9), precision="bf16", optimizer="adam8bit", recipe=master).as_json()[
        "optimizer_gb"
    ] == pytest.approx(6.0)  # DeepSpeed's: fp32 master weights + two 1-byte moments
    proc = meshkit("estimate", "--params", "1e9", "--precision", "fp32", "--optimizer", "adam8bit", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["optimizer_gb"] == pytest.approx(2.0)


# s = 4, b = 2, h = 8, a = 2: sbh = 64, as²b = 64
CASE = {"s": 4, "b": 2, "h": 8, "a": 2}


@pytest.mark.parametrize(
    ("element", "tp", "sp", "recompute", "dropout", "expected"),
    [
        (2, 1, False, "none", True, 64 * 34 + 5 * 64),  # sbh(34 + 5as/h): 2496
        (2, 2, True, "none", True, (64 * 34 + 5 * 64) / 2),  # sbh(34/t + 5as/(ht))
        (2, 2, False, "none", True, 64 * (10 + 24 / 2) + 5 * 64 / 2),  # sbh(10 + 24/t + 5as/(ht))
        (2, 2, True, "selective", True, 64 * 34 / 2),  # sbh·34/t
        (2, 1, False, "full", True, 2 * 64),  # 2sbh: the layer input only
        (4, 1, False, "none", False, 64 * 64 + 8 * 64),  # fp32 without dropout: 32·2 sbh + 4·2 as²b
    ],
)
def test_activation_bytes_follow_korthikanti(element, tp, sp, recompute, dropout, expected) -> None:
    got = layer_activation_bytes(**CASE, element=element, tp=tp, sp=sp, recompute=recompute, dropout=dropout)
    assert got == pytest.approx(expected)


def test_the_activation_line_scales_with_layers_and_context_parallel() -> None:
    shape = ModelShape.transformer(layers=4, hidden=64, heads=4, vocab=0)
    eager = StepRecipe(attention="eager")  # (Korthikanti's count: the scores kept)
    one = estimate_memory(shape, seq_len=128, micro_batch=2, precision="fp32", recipe=eager).as_json()
    expected = 4 * layer_activation_bytes(
        s=128, b=2, h=64, a=4, element=4, tp=1, sp=False, recompute="none", dropout=False
    )
    assert one["activations_gb"] == pytest.approx(expected / 1e9)
    halved = estimate_memory(shape, seq_len=128, micro_batch=2, precision="fp32", cp=2, recipe=eager).as_json()
    assert halved["activations_gb"] < one["activations_gb"] / 2  # the sequence halves, and the attention scores quarter
    fused = estimate_memory(shape, seq_len=128, micro_batch=2, precision="fp32").as_json()  # SDPA: no scores
    lse = 4 * 4 * 128 * 2 * 4  # a fp32 log-sum-exp per head and token, 4 layers
    assert fused["activations_gb"] == pytest.approx((expected - 4 * 4 * 128 * 128 * 2 * 8 + lse) / 1e9)
    assert "no scores" in fused["formulas"]["activations"]


def test_zero3_buffers_hold_two_gathered_layers() -> None:
    shape = ModelShape.transformer(layers=8, hidden=512, heads=8, vocab=1000)
    out = estimate_memory(shape, zero_stage=3, dp=8, precision="bf16", zero3_unit_mb=0).as_json()
    assert out["buffers_gb"] == pytest.approx(2 * 2 * shape.largest_layer_params / 1e9)


def test_zero3_small_blocks_are_gathered_in_units_of_sharding_unit_mb() -> None:
    shape = ModelShape.transformer(layers=8, hidden=256, heads=8, vocab=1000)  # 3.1 MB of fp32 a block
    block = shape.largest_layer_params
    assert shape.zero3_unit_params(unit_mb=13) == 4 * block and shape.zero3_unit_params(unit_mb=1) == block
    assert shape.zero3_unit_params(tp=2, unit_mb=13) == 8 * block / 2  # a tp rank groups its own halves
    two_units = estimate_memory(shape, zero_stage=3, dp=8, precision="bf16", zero3_unit_mb=13).as_json()
    assert two_units["buffers_gb"] == pytest.approx(2 * 2 * 4 * block / 1e9)  # the unit in use and the next
    uneven = estimate_memory(shape, zero_stage=3, dp=8, precision="bf16", zero3_unit_mb=20).as_json()
    assert uneven["buffers_gb"] == pytest.approx(2 * (6 + 2) * block / 1e9)  # units of 6 blocks, then the last 2
    one_unit = estimate_memory(shape, zero_stage=3, dp=8, precision="bf16", zero3_unit_mb=100).as_json()
    assert one_unit["buffers_gb"] == pytest.approx(2 * 8 * block / 1e9)  # every block in one unit: held once


def test_gradients_freed_every_step_meet_the_activations_as_the_larger_of_the_two() -> None:
    shape = ModelShape.transformer(layers=8, hidden=512, heads=8, vocab=1000)
    exact = StepRecipe(optimizer_step="fused", allocator_allowance=0.0)  # (no temporaries, no slack)

    def total(**layout: object) -> tuple[float, dict]:
        out = estimate_memory(shape, seq_len=512, micro_batch=4, precision="fp32", runtime_gb=0.02, recipe=exact,
                              **layout)  # fmt: skip
        return out.total_gb, out.as_json()

    for layout in ({"zero_stage": 3, "dp": 4}, {"zero_stage": 2, "dp": 4}, {"pp": 2, "dp": 2}, {}):
        peak, out = total(**layout)  # shards built in backward, a pipeline's freed in its step, set_to_none
        rest = out["params_gb"] + out["optimizer_gb"] + out["buffers_gb"] + out["runtime_gb"]
        backward = out["activations_gb"] + out["working set_gb"]  # (saved tensors, one layer's gradients)
        assert peak == pytest.approx(rest + max(out["grads_gb"], backward))
        assert out["grads_gb"] > 0 and out["activations_gb"] > out["grads_gb"] and "max(" in out["formulas"]["total"]
    for layout in ({"zero_stage": 1, "dp": 4}, {"dp": 4, "gradient_as_bucket_view": True}):
        peak, out = total(**layout)  # a full buffer kept across steps, or allocated as backward starts
        assert peak == pytest.approx(sum(v for k, v in out.items() if k.endswith("_gb") and "peak" not in k
                                         and k != "total_gb"))  # fmt: skip
    assert total()[1]["runtime_gb"] == 0.02


def test_the_step_outweighs_backward_under_full_recomputation_with_foreach_temporaries_and_one_layer() -> None:
    """Full recomputation leaves backward little: the peak moves to the step, where the gradients, one recomputed
    layer and foreach Adam's temporary (one fp32 tensor per state element) meet; 2 % slack on top."""
    shape = ModelShape.transformer(layers=8, hidden=512, heads=8, vocab=1000, ffn=1408, kv_heads=4)
    out = estimate_memory(shape, seq_len=512, micro_batch=4, precision="bf16", activation_checkpointing="full")
    assert out.step_gb > out.backward_gb and out.gb("recomputed layer") > 0
    assert out.gb("optimizer step") == pytest.approx(4 * shape.params / 1e9)
    assert out.total_gb == pytest.approx(1.02 * out.step_gb)
    fused = estimate_memory(shape, seq_len=512, micro_batch=4, precision="bf16", activation_checkpointing="full",
                            recipe=StepRecipe(optimizer_step="fused"))  # fmt: skip
    assert fused.gb("optimizer step") == 0.0 and fused.total_gb < out.total_gb


def test_impossible_layouts_say_why() -> None:
    shape = ModelShape.transformer(layers=2, hidden=64, heads=4, vocab=10)
    with pytest.raises(EstimateError, match="tp=3 does not divide the 4 attention heads"):
        estimate_memory(shape, tp=3)
    with pytest.raises(EstimateError, match="pp=4 is more than the 2 layers"):
        estimate_memory(shape, pp=4)
    with pytest.raises(EstimateError, match="zero_stage=4"):
        estimate_memory(shape, zero_stage=4)


def test_a_hugging_face_config_with_missing_keys_names_them(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "vocab_size": 100}))
    with pytest.raises(EstimateError, match="lacks num_hidden_layers, num_attention_heads"):
        ModelShape.from_hf_config(path)


@pytest.mark.slow
def test_the_command_prints_json_with_every_line(tmp_path) -> None:
    proc = meshkit("estimate", "--params", "7.5e9", "--dp", "64", "--zero-stage", "1", "--runtime-gb", "0.5", "--json",
                   "--weights", "master")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["runtime_gb"] == 0.5
    for key in ("params_gb", "grads_gb", "optimizer_gb", "activations_gb", "buffers_gb", "total_gb"):
        assert key in out
    assert out["params_gb"] + out["grads_gb"] + out["optimizer_gb"] == pytest.approx(31.40625)
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  dim: 64\n  n_layers: 2\n  n_heads: 4\n  widht: 3\n")
    bad = meshkit("estimate", str(config))
    assert bad.returncode == 2 and "model.widht" in bad.stderr and "Traceback" not in bad.stderr
    config.write_text("model:\n  dim: 64\n  n_layers: 2\n  n_heads: 4\n")
    table = meshkit("estimate", str(config), "--tp", "2", "--seq-len", "64")
    assert table.returncode == 0 and "activations" in table.stdout and "total" in table.stdout


def test_a_reference_copy_costs_the_policys_weights_as_laid_out_and_the_others_nothing() -> None:
    from meshkit.planning.estimate import ModelShape, estimate_memory

    shape = ModelShape.transformer(layers=8, hidden=1024, heads=8, vocab=32000)
    for zero_stage, dp in ((0, 1), (3, 4)):
        plain = estimate_memory(shape, zero_stage=zero_stage, dp=dp)
        copy = estimate_memory(shape, zero_stage=zero_stage, dp=dp, reference="copy")
        assert copy.gb("reference") == pytest.approx(plain.gb("params"))  # sharded alike under ZeRO-3
        slack = 1 + StepRecipe().allocator_allowance
        assert copy.total_gb == pytest.approx(plain.total_gb + plain.gb("params") * slack)
        for choice in ("adapters", "precomputed"):
            assert estimate_memory(shape, zero_stage=zero_stage, dp=dp, reference=choice).total_gb == plain.total_gb
