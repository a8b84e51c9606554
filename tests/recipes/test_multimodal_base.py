"""Multimodal checkpoints fine-tuned on text, as Axolotl's Gemma 3/4, Llama 4 and Mistral 3 examples do: the
structure layer finds the language model's layers (not the vision tower's), names the towers a text batch never
runs, `meshkit finetune` freezes them and exports them as loaded; a checkpoint transformers maps to no causal LM
loads as image-text-to-text, and a multimodal class asked by name trains the causal LM transformers maps it to.
(Every layout on such a model: `tests/parallel/test_hf_layouts.py`, gemma3_vision.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.models.structure import describe  # noqa: E402
from meshkit.recipes.hf_base import text_model_class  # noqa: E402
from meshkit.tuning.lora import linear_targets  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import run_finetune, write_config  # noqa: E402
from tests.helpers.hf_models import causal_lm, config  # noqa: E402

TOWERS = ("model.vision_tower", "model.multi_modal_projector")


def test_the_text_models_layers_are_the_blocks_and_the_towers_are_named() -> None:
    model = causal_lm("gemma3_vision")  # (its vision tower has more layers than its language model)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    structure = describe(model)
    assert structure.blocks == "model.language_model.layers" and structure.causal_lm
    assert structure.towers == TOWERS
    assert structure.first_stage == ("model.language_model.embed_tokens",)
    assert structure.last_stage == ("model.language_model.norm", "lm_head")
    # lora_target_linear: the language model's layers only (by full path: the tower has q_proj layers too)
    targets = linear_targets(model)
    assert "model.language_model.layers.0.self_attn.q_proj" in targets
    assert all(target.startswith("model.language_model.") for target in targets)


def test_a_classifier_head_is_no_tower() -> None:
    from transformers import AutoModelForSequenceClassification

    reward = AutoModelForSequenceClassification.from_config(config("llama", num_labels=1))
    structure = describe(reward)
    assert structure.classifier == "score" and structure.towers == ()


def test_the_recipe_takes_what_the_structure_layer_calls_a_causal_lm_or_a_classifier() -> None:
    from types import SimpleNamespace

    from transformers import (
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        T5Config,
        T5ForConditionalGeneration,
    )

    from meshkit.recipes.hf_base import BaseModelError, _causal_lm

    def settings(**flags: bool) -> SimpleNamespace:
        return SimpleNamespace(base_model="base", base_model_config=None, **flags)

    assert _causal_lm(causal_lm("gemma3_vision"), settings())  # a multimodal model's text forward: a causal LM
    reward = AutoModelForSequenceClassification.from_config(config("llama", num_labels=1))
    assert _causal_lm(reward, settings(reward_model=True)) is reward
    steps = AutoModelForTokenClassification.from_config(config("llama", num_labels=2))
    assert _causal_lm(steps, settings(process_reward_model=True)) is steps
    with pytest.raises(BaseModelError, match="trains causal LMs; 'base' builds LlamaForSequenceClassification"):
        _causal_lm(reward, settings())
    with pytest.raises(BaseModelError, match="trains sequence classifiers .* builds LlamaForTokenClassification"):
        _causal_lm(steps, settings(reward_model=True))
    encoder_decoder = T5ForConditionalGeneration(T5Config(d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8))
    with pytest.raises(BaseModelError, match="builds T5ForConditionalGeneration"):  # no next-token logits of its input
        _causal_lm(encoder_decoder, settings())


def test_the_class_trained_on_text_follows_transformers_mappings() -> None:
    from transformers import Gemma3Config, Llama4Config, Mistral3Config

    # Mistral 3: no causal-LM class in transformers: image-text-to-text, as Axolotl loads it
    assert text_model_class("AutoModelForCausalLM", Mistral3Config()) == "AutoModelForImageTextToText"
    # Llama 4's multimodal class asked by name: the causal LM transformers maps the checkpoint to
    assert text_model_class("Llama4ForConditionalGeneration", Llama4Config()) == "Llama4ForCausalLM"
    # Gemma 3: transformers' causal-LM mapping is the multimodal class itself; nothing changes
    assert text_model_class("AutoModelForCausalLM", Gemma3Config()) == "AutoModelForCausalLM"
    assert text_model_class("Gemma3ForConditionalGeneration", Gemma3Config()) == "Gemma3ForConditionalGeneration"
    # another package's class (mamba_ssm's, Axolotl's Mamba example): the checkpoint's own causal LM
    from transformers import MambaConfig

    assert text_model_class("MambaLMHeadModel", MambaConfig()) == "MambaForCausalLM"
    from transformers import VoxtralConfig  # an audio-text checkpoint: its own class (the audio tower never runs)

    assert text_model_class("AutoModelForCausalLM", VoxtralConfig()) == "VoxtralForConditionalGeneration"
    assert text_model_class("NoSuchForCausalLM", Mistral3Config()) == "NoSuchForCausalLM"  # (none: refused later)


def _save(model: torch.nn.Module, tokenizer, out):
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gemma3_base(tmp_path_factory, tokenizer):
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    model = causal_lm("gemma3_vision", text_config=config("gemma3", vocab_size=len(tokenizer), **ids).to_dict())
    return _save(model, tokenizer, tmp_path_factory.mktemp("gemma3-vision") / "base")


def test_a_full_fine_tune_freezes_the_towers_and_exports_them_as_loaded(tmp_path, material, gemma3_base) -> None:
    from transformers import AutoModelForImageTextToText

    config = write_config(tmp_path / "ft.yaml", {**material, "base": gemma3_base})
    summary = run_world(run_finetune, 2, str(config), [], timeout=240)[0]
    base = AutoModelForImageTextToText.from_pretrained(gemma3_base).state_dict()
    merged = AutoModelForImageTextToText.from_pretrained(summary["outputs"]["merged"])
    assert type(merged).__name__ == "Gemma3ForConditionalGeneration"
    exported = merged.state_dict()
    towers = {name for name in base if name.startswith(TOWERS)}
    text = {name: tensor for name, tensor in base.items() if name not in towers and name != "lm_head.weight"}
    assert towers and summary["trainable_parameters"] == sum(tensor.numel() for tensor in text.values())
    assert exported.keys() == base.keys()
    assert all(torch.equal(exported[name], base[name]) for name in towers)  # exported as loaded
    changed = [name for name in text if not torch.equal(exported[name], base[name])]
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in changed
    assert summary["losses"][-1] < summary["losses"][0]


def test_llama4s_multimodal_class_trains_its_language_model_with_lora(tmp_path, material, tokenizer, capfd) -> None:
    from transformers import AutoModelForCausalLM, Llama4Config, Llama4ForConditionalGeneration

    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=8, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)  # fmt: skip
    torch.manual_seed(0)
    base = _save(Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision)), tokenizer,
                 tmp_path / "llama4")  # fmt: skip
    keys = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"],
            "model_type": "Llama4ForConditionalGeneration", "learning_rate": 0.05, "max_steps": 6}  # fmt: skip
    config = write_config(tmp_path / "ft.yaml", {**material, "base": base}, **keys)
    summary = run_world(run_finetune, 1, str(config), [], timeout=240)[0]
    assert "trains its language model, Llama4ForCausalLM" in capfd.readouterr().out
    assert summary["losses"][-1] < summary["losses"][0]
    merged = AutoModelForCausalLM.from_pretrained(summary["outputs"]["merged"])
    original = AutoModelForCausalLM.from_pretrained(base)  # (the checkpoint's language model, as loaded)
    assert type(merged).__name__ == "Llama4ForCausalLM"
    trained, loaded = merged.model.layers[0].self_attn, original.model.layers[0].self_attn
    assert not torch.equal(trained.q_proj.weight, loaded.q_proj.weight)  # (LoRA on q_proj and v_proj only)
    assert torch.equal(trained.k_proj.weight, loaded.k_proj.weight)


def test_a_target_regex_written_for_transformers_4_names_finds_the_renamed_modules() -> None:
    """Axolotl's Voxtral example targets 'language_model.model.layers.[\\d]+.(mlp|self_attn)...', the names
    transformers 4 gave; transformers 5 calls them model.language_model.layers...: matched through its renames."""
    from types import SimpleNamespace

    from transformers import VoxtralConfig, VoxtralForConditionalGeneration

    from meshkit.tuning.lora import apply_lora, old_names_note

    text = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
    }
    audio = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_mel_bins": 16, "max_source_positions": 8}  # fmt: skip
    model = VoxtralForConditionalGeneration(VoxtralConfig(text_config=text, audio_config=audio))
    pattern = r"language_model.model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"
    settings = SimpleNamespace(
        lora_model_dir=None, lora_target_parameters=None, lora_target_linear=False, lora_target_modules=pattern,
        lora_r=4, lora_alpha=8, lora_dropout=0.0, base_model="base", adapter="lora",
    )  # fmt: skip
    note = old_names_note(model, settings)
    assert note is not None and "14 modules matched" in note
    adapted = apply_lora(model, settings)
    wrapped = sorted({n.split(".lora_A")[0] for n, _ in adapted.named_parameters() if "lora_A" in n})
    assert len(wrapped) == 14 and all(".model.language_model.layers." in name for name in wrapped)
    as_written = SimpleNamespace(
        **{**vars(settings), "lora_target_modules": r"model.language_model.layers.0.mlp.up_proj"}
    )
    assert old_names_note(model, as_written) is None  # (a regex that matches today's names is left alone)
