"""Quantized bases (bitsandbytes on CPU): LoRA over an int8 base and QLoRA over a 4-bit one track LoRA on the
dequantized base, train the same in two ranks as in one (DDP, ZeRO-2), export a merged model that `from_pretrained`
loads with the adapter-on-base logits, and refuse in one line what cannot run. A 4-bit base also trains under
ZeRO-3 (its packed weights sharded)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="the hf extra (peft) is not installed")
pytest.importorskip("bitsandbytes", reason="the hf extra (bitsandbytes) is not installed")

from meshkit.config.resolve import ConfigError  # noqa: E402
from meshkit.recipes.finetune_config import resolve_finetune  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402

TIMEOUT = 240
QUANTIZED = {"8bit": {"load_in_8bit": True}, "4bit": {"adapter": "qlora", "load_in_4bit": True}}
# 4 bits: the forward dequantizes the weight and multiplies in float32, as LoRA on the dequantized base does.
# int8 (LLM.int8): the activations are quantized too (per row, to int8), a loss difference of a few 1e-4.
TOLERANCE = {"4bit": 1e-5, "8bit": 2e-3}


def _quantized(material, kind: str):
    from transformers import AutoModelForCausalLM

    from meshkit.models.quantized import keep_training_layout
    from meshkit.recipes.finetune_settings import FinetuneSettings
    from meshkit.recipes.quantized_base import quantization_config

    settings = FinetuneSettings(base_model=material["base"], datasets=[{"path": "x", "type": "alpaca"}],
                                **lora_keys(**QUANTIZED[kind]))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        material["base"], quantization_config=quantization_config(settings), dtype=torch.float32
    )
    # On AVX512-BF16 hosts bitsandbytes repacks 4-bit weights for an eval forward, which fails on layers narrower
    # than its block size (this tiny base's): the reference stays in the layout it was loaded in, as meshkit's does.
    keep_training_layout(model)
    return model


def _dequantized_base(material, kind: str, out: Path) -> Path:
    """The quantized base's weights in full precision, as a plain save_pretrained directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshkit.models.quantized import full_precision_state

    quantized = _quantized(material, kind)
    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(material["base"]))
    plain.load_state_dict(full_precision_state(quantized, quantized.state_dict()))
    plain.save_pretrained(out)
    for file in material["base"].glob("tokenizer*"):
        shutil.copy(file, out / file.name)
    return out


def _train(tmp_path: Path, material, name: str, world: int = 1, base: Path | None = None, **keys) -> dict:
    out = tmp_path / name
    out.mkdir()
    config = write_config(out / "c.yml", {**material, "base": base or material["base"]}, val_set_size=4, **keys)
    return run_world(run_finetune, world, str(config), [f"output_dir={out / 'out'}"], timeout=TIMEOUT)[0]


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_lora_over_a_quantized_base_tracks_lora_on_its_dequantized_weights(tmp_path, material, kind) -> None:
    dequantized = _dequantized_base(material, kind, tmp_path / "dequantized")
    reference = _train(tmp_path, material, "plain", base=dequantized, **lora_keys())
    quantized = _train(tmp_path, material, "quantized", **lora_keys(**QUANTIZED[kind]))
    rtol = TOLERANCE[kind]
    torch.testing.assert_close(torch.tensor(quantized["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=0)
    assert quantized["losses"][-1] < quantized["losses"][0]
    assert quantized["trainable_parameters"] == reference["trainable_parameters"]


@pytest.mark.parametrize(  # (4 bits under DDP: in make test-full; its ZeRO-3 run shards the same packed weights)
    ("kind", "layout"),
    [pytest.param("4bit", "zero_stage=0", marks=pytest.mark.sweep), ("4bit", "zero_stage=3"), ("8bit", "zero_stage=2")],
)
def test_two_ranks_equal_one_and_the_merged_export_is_the_adapter_on_the_base(tmp_path, material, kind, layout):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    keys = lora_keys(**QUANTIZED[kind])
    one = _train(tmp_path, material, "one", micro_batch_size=4, **keys)
    out = tmp_path / "two"
    out.mkdir()
    config = write_config(out / "c.yml", material, val_set_size=4, **keys)
    two = run_world(run_finetune, 2, str(config), [f"output_dir={out / 'out'}", layout], timeout=TIMEOUT)[0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    adapted = PeftModel.from_pretrained(_quantized(material, kind), two["outputs"]["adapter"]).eval()
    merged = AutoModelForCausalLM.from_pretrained(two["outputs"]["merged"]).eval()
    assert "quantization_config" not in merged.config.to_dict()
    assert all(p.dtype == torch.float32 for p in merged.parameters())  # dequantized, adapter folded in
    with torch.no_grad():
        expected, got = adapted(ids).logits, merged(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[kind] * 20)


def test_a_conv1d_base_quantized_exports_its_weights_in_the_checkpoints_layout(tmp_path, material) -> None:
    """GPT-2's Conv1D layers hold [in, out] weights; transformers quantizes them as Linear ([out, in]): the merged
    export writes them back as the GPT-2 checkpoint holds them (from_pretrained stopped on the shapes)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshkit.models.quantized import keep_training_layout
    from meshkit.recipes.finetune_settings import FinetuneSettings
    from meshkit.recipes.quantized_base import quantization_config
    from tests.helpers.finetune_runs import make_gpt2_base

    base = make_gpt2_base(tmp_path, material)
    keys = lora_keys(**QUANTIZED["4bit"], lora_target_linear=False, lora_target_modules=["c_attn", "c_fc"])
    summary = _train(tmp_path, {**material, "base": base}, "gpt2", **keys)
    settings = FinetuneSettings(base_model=base, datasets=[{"path": "x", "type": "alpaca"}], **keys)
    quantized = AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization_config(settings))
    keep_training_layout(quantized)  # (see `_quantized`)
    adapted = PeftModel.from_pretrained(quantized, summary["outputs"]["adapter"]).eval()
    merged = AutoModelForCausalLM.from_pretrained(summary["outputs"]["merged"]).eval()
    assert merged.transformer.h[0].mlp.c_fc.weight.shape == (32, 128)  # [in, out], as GPT-2 holds it
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=0, atol=TOLERANCE["4bit"] * 20)


@pytest.mark.parametrize(
    ("keys", "assignments", "expected"),
    [
        ({"load_in_8bit": True, "load_in_4bit": True}, [], "two quantizations: keep one"),
        ({"adapter": None, "load_in_4bit": True}, [], "a quantized base is frozen: train adapters over it"),
        ({"gptq": True, "adapter": "qlora"}, [], "gptq: true loads an already quantized base"),
    ],
)
def test_quantization_settings_that_contradict_are_one_line(tmp_path, material, keys, assignments, expected):
    config = write_config(tmp_path / "c.yml", material, **{**lora_keys(), **keys})
    with pytest.raises(ConfigError, match=expected) as caught:
        resolve_finetune(config, assignments, env={})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("keys", "assignments", "expected"),
    [
        ({"load_in_8bit": True}, ["zero_stage=3"], "ZeRO-3 shards 4-bit layers only"),
        (
            {"adapter": "qlora", "bnb_4bit_quant_storage": "float32"},
            ["zero_stage=3", "precision=bf16"],
            "garbles packed 4-bit weights",
        ),
        ({"load_in_8bit": True}, ["tp=2"], "not split by tensor or pipeline parallel"),
        ({"gptq": True}, [], "pip install gptqmodel"),
    ],
)
def test_layouts_and_bases_a_quantized_base_cannot_take_are_one_line(tmp_path, material, keys, assignments, expected):
    import importlib.util

    if keys.get("gptq") and importlib.util.find_spec("gptqmodel") is not None:
        pytest.skip("gptqmodel is installed here: a GPTQ base would load")
    config = write_config(tmp_path / "c.yml", material, **{**lora_keys(), **keys})
    world = 2 if assignments else 1
    with pytest.raises(Exception, match=expected) as caught:
        run_world(run_finetune, world, str(config), assignments, timeout=TIMEOUT)
    assert expected in str(caught.value)


def test_a_qlora_run_resumes_where_it_stopped(tmp_path, material) -> None:
    config = write_config(tmp_path / "c.yml", material, **lora_keys(adapter="qlora"), max_steps=6, save_steps=2)
    args = [f"output_dir={tmp_path / 'out'}"]
    whole = run_world(run_finetune, 1, str(config), args, timeout=TIMEOUT)[0]
    checkpoints = tmp_path / "out" / "checkpoints"
    for late in ("step-000004", "step-000006"):
        shutil.rmtree(checkpoints / late)
    resumed = run_world(run_finetune, 1, str(config), [*args, "auto_resume_from_checkpoints=true"], timeout=TIMEOUT)[0]
    assert resumed["resumed_at_step"] == 2
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(whole["losses"]), rtol=1e-6, atol=0)


def test_dpo_over_a_4bit_base_tracks_dpo_on_its_dequantized_weights(tmp_path, material) -> None:
    """QLoRA DPO: the reference is the quantized base with adapters off; losses and rewards track LoRA DPO on the
    dequantized weights."""
    from tests.helpers.preference_runs import dpo_keys, write_preference_data

    data = write_preference_data(tmp_path)
    dequantized = _dequantized_base(material, "4bit", tmp_path / "dequantized")
    keys = {**dpo_keys(data), "micro_batch_size": 4}
    reference = _train(tmp_path, material, "plain", base=dequantized, **keys, **lora_keys())
    quantized = _train(tmp_path, material, "quantized", **keys, **lora_keys(**QUANTIZED["4bit"]))
    torch.testing.assert_close(
        torch.tensor(quantized["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6
    )
    assert quantized["losses"][0] == pytest.approx(0.6931472, abs=1e-6)  # the policy starts as its reference
    assert quantized["losses"][-1] < quantized["losses"][0]


def test_an_int8_layer_takes_inputs_of_more_than_three_dims(material) -> None:
    """bitsandbytes' int8 matmul folds only a 3-D input; a model projecting a 4-D tensor (Kimi-Linear's latents)
    gets its leading dims folded and restored around the layer."""
    from meshkit.recipes.finetune_settings import FinetuneSettings
    from meshkit.recipes.quantized_base import load_quantized_base

    settings = FinetuneSettings(base_model=material["base"], datasets=[{"path": "x", "type": "alpaca"}],
                                **lora_keys(**QUANTIZED["8bit"]))  # fmt: skip
    layer = load_quantized_base(settings, "eager", torch.device("cpu")).model.layers[0].self_attn.q_proj
    inputs = torch.randn(2, 1, 3, layer.in_features)
    out = layer(inputs)
    assert out.shape == (2, 1, 3, layer.out_features)
    torch.testing.assert_close(out[1, 0], layer(inputs[1, 0]))  # (the same rows as the 2-D call)
    assert "_meshkit_leading_dims" not in layer.__dict__
