"""`peft_init_lora_weights` (and `peft.loftq_config`): peft's PiSSA, OLoRA, LoftQ, gaussian and orthogonal starts,
computed by peft on each whole layer of the base and copied into every rank's shards. PiSSA leaves the model
unchanged at the start (principal part in the adapters, the rest in the base), ZeRO-3 at world 2 starts and trains
as one process, and the exported adapter applies to the original base as merged/ says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from meshkit.recipes.finetune_settings import FinetuneSettings  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402

TIMEOUT = 240


def _run(tmp_path: Path, material: dict, world: int, name: str, *args: str, **keys) -> dict:
    config = write_config(tmp_path / f"{name}.yaml", material, val_set_size=4, **keys)
    return run_world(run_finetune, world, str(config), [f"output_dir={tmp_path / name}", *args], timeout=TIMEOUT)[0]


def _settings(material: dict, **keys) -> FinetuneSettings:
    return FinetuneSettings.model_validate(
        {"base_model": str(material["base"]), "datasets": [{"path": "d.jsonl", "type": "alpaca"}], **keys}
    )


def test_initialisations_are_read_by_peft_name_and_the_impossible_ones_are_one_line(material) -> None:
    assert _settings(material, **lora_keys()).lora_init is None
    assert _settings(material, **lora_keys(peft_init_lora_weights="pissa_niter_4")).lora_init == "pissa_niter_4"
    assert _settings(material, **lora_keys(peft={"loftq_config": {"loftq_bits": 4}})).lora_init == "loftq"
    assert _settings(material, **lora_keys(peft_init_lora_weights=False)).lora_init == "false"
    refusals = {
        "calibration pass, which meshkit does not run: use pissa": lora_keys(peft_init_lora_weights="eva"),
        "is not an initialisation meshkit runs": lora_keys(peft_init_lora_weights="pisa"),
        "which a quantized base cannot take": lora_keys(adapter="qlora", peft_init_lora_weights="olora"),
        "set precompute_ref_log_probs: true": lora_keys(rl="dpo", peft_init_lora_weights="pissa"),
        "starts LoRA adapters: set adapter: lora": {"peft_init_lora_weights": "gaussian"},
    }
    for words, keys in refusals.items():
        with pytest.raises(ValueError, match=words):
            _settings(material, **keys)


@pytest.mark.slow
def test_pissa_starts_at_the_base_trains_alike_under_zero3_and_exports_for_the_original_base(
    tmp_path, material
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    plain = _run(tmp_path, material, 1, "plain", "micro_batch_size=4", **lora_keys())
    # with another rank for o_proj (peft's rank_pattern): each layer starts at its own rank
    keys = lora_keys(peft_init_lora_weights="pissa", lora_rank_pattern={"o_proj": 2})
    pissa = _run(tmp_path, material, 1, "pissa", "micro_batch_size=4", **keys)
    sharded = _run(tmp_path, material, 2, "sharded", "zero_stage=3", **keys)
    # residual base + principal adapters = the base: the first loss is the plain LoRA's (B = 0 there)
    torch.testing.assert_close(torch.tensor(pissa["losses"][0]), torch.tensor(plain["losses"][0]), rtol=1e-5, atol=0)
    assert abs(pissa["losses"][-1] - plain["losses"][-1]) > 1e-4  # it trains from another start
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(pissa["losses"]), rtol=1e-5, atol=0)
    out = tmp_path / "pissa"
    config = json.loads((out / "adapter_config.json").read_text())
    # trained and initial adapters side by side: twice the rank, the pattern's too
    assert (config["r"], config["rank_pattern"], config["init_lora_weights"]) == (8, {"o_proj": 4}, True)
    ids = torch.tensor([[5, 17, 42, 9, 33, 61]])
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")(ids).logits
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(material["base"]), out)(ids).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(  # LoftQ in the suite (it rewrites the base too); the others in make test-full
    "mode", ["loftq", pytest.param("olora", marks=pytest.mark.sweep), pytest.param("gaussian", marks=pytest.mark.sweep)]
)
def test_other_starts_run_in_a_tensor_parallel_world_as_in_one_process(tmp_path, material, mode: str) -> None:
    keys = (
        lora_keys(peft={"loftq_config": {"loftq_bits": 4}})
        if mode == "loftq"
        else lora_keys(peft_init_lora_weights=mode)
    )
    one = _run(tmp_path, material, 1, "one", "micro_batch_size=4", **keys)
    tp = _run(tmp_path, material, 2, "tp", "tp=2", "micro_batch_size=4", **keys)
    torch.testing.assert_close(torch.tensor(tp["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    default = _run(tmp_path, material, 1, "default", "micro_batch_size=4", **lora_keys())
    if mode == "loftq":  # the base becomes its 4-bit quantization: the model starts elsewhere
        assert abs(one["losses"][0] - default["losses"][0]) > 1e-6
    if mode == "olora":  # an exact split too: it starts where the base is
        torch.testing.assert_close(
            torch.tensor(one["losses"][0]), torch.tensor(default["losses"][0]), rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("bits", [4, 8])
def test_loftq_adapters_take_up_part_of_the_quantization_error(bits: int) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    from meshkit.tuning.lora_init import _loftq

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.add_module("layer", torch.nn.Linear(64, 32, bias=False))
    weight = holder.layer.weight.detach().clone()
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["layer"]), holder)
    layer = holder.layer
    _loftq(layer, bits, 1)
    base = layer.get_base_layer().weight
    adapted = base + layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    quantized_error = (base - weight).abs().mean()
    assert 0 < (adapted - weight).abs().mean() < quantized_error  # the base quantized, the adapters hold some error
    assert quantized_error < (0.001 if bits == 8 else 0.02)
