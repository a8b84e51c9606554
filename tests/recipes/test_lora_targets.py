"""Which layers LoRA adapts, as Axolotl's keys say: a list names layers (peft matches each as a path suffix), one
string is a regular expression over whole module paths (as peft reads a string); a classification head is left
out of lora_target_linear (it trains whole)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from meshkit.recipes.finetune_settings import FinetuneSettings  # noqa: E402
from meshkit.tuning.lora import apply_lora  # noqa: E402


def _settings(**keys) -> SimpleNamespace:
    base = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": False,
            "lora_target_modules": None, "base_model": "x"}  # fmt: skip
    return SimpleNamespace(**{**base, **keys})


def _adapted(model) -> set[str]:
    return {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A" in name}


def _tiny(classifier: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, num_labels=1)  # fmt: skip
    return (LlamaForSequenceClassification if classifier else LlamaForCausalLM)(config)


def test_one_string_is_a_regular_expression_over_whole_paths() -> None:
    pattern = r"model.layers.[\d]+.(mlp|self_attn).(up|q)_proj"
    settings = FinetuneSettings(base_model="x", datasets=[{"path": "d.jsonl", "type": "alpaca"}],
                                lora_target_modules=pattern)  # fmt: skip
    assert settings.lora_target_modules == pattern  # (kept a string: not made a one-name list)
    peft_model = apply_lora(_tiny(), _settings(lora_target_modules=pattern))
    assert {name.rsplit(".", 1)[-1] for name in _adapted(peft_model)} == {"up_proj", "q_proj"}
    assert len(_adapted(peft_model)) == 4  # two layers
    listed = apply_lora(_tiny(), _settings(lora_target_modules=("q_proj",)))
    assert {name.rsplit(".", 1)[-1] for name in _adapted(listed)} == {"q_proj"}


def test_a_classification_head_is_not_a_linear_target() -> None:
    peft_model = apply_lora(_tiny(classifier=True), _settings(lora_target_linear=True, reward_model=True))
    assert not any("score" in name for name in _adapted(peft_model))
    assert any("score.modules_to_save" in name for name, _ in peft_model.named_parameters())  # (trains whole)
