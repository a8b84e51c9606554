"""A base released quantized: gpt-oss in MXFP4 (Axolotl's `model_quantization_config: Mxfp4Config` with
`dequantize: true`) trains over its dequantized weights — streamed in as transformers' own dequantization makes
them — and exports a model that loads with `from_pretrained` as a plain (unquantized) checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402
from tests.helpers.moe_models import save_mxfp4_gpt_oss  # noqa: E402


def test_an_mxfp4_base_trains_dequantized_and_exports_unquantized(tmp_path, material, tokenizer, capfd) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    base = tmp_path / "gpt-oss-mxfp4"
    banks = save_mxfp4_gpt_oss(base, tokenizer, vocab_size=len(tokenizer))
    keys = dict(lora_keys(), base_model=str(base), model_quantization_config="Mxfp4Config",
                model_quantization_config_kwargs={"dequantize": True})  # fmt: skip
    config = write_config(tmp_path / "c.yml", material, **keys)
    summary = run_world(run_finetune, 1, str(config), [f"output_dir={tmp_path / 'out'}"], timeout=240)[0]
    assert "the base is stored in MXFP4: its expert weights are dequantized as they load" in capfd.readouterr().out
    assert len(summary["losses"]) == 4 and all(loss == loss for loss in summary["losses"])  # (no NaN)
    merged_dir = Path(summary["outputs"]["merged"])
    assert "quantization_config" not in json.loads((merged_dir / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    released = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).state_dict()
    for name in banks:  # no adapter on the expert banks: they export as the release's dequantized values
        assert torch.equal(merged[name], released[name]), name


def test_a_second_quantization_of_a_released_one_is_refused(tmp_path, material) -> None:
    from meshkit.recipes.finetune_config import resolve_finetune

    config = write_config(tmp_path / "c.yml", material, model_quantization_config="Mxfp4Config", load_in_4bit=True,
                          adapter="qlora")  # fmt: skip
    with pytest.raises(Exception, match="model_quantization_config and load_in_8bit / load_in_4bit / gptq ask for two"):
        resolve_finetune(str(config), [])
    config = write_config(tmp_path / "c.yml", material, model_quantization_config="FineGrainedFP8Config")
    with pytest.raises(Exception, match="FineGrainedFP8Config .* is not supported yet: start from the model's bf16"):
        resolve_finetune(str(config), [])
