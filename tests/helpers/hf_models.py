"""Tiny transformers causal LMs built offline from configs (random init), one per family."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, POSITIONS = 64, 32, 4, 2, 4, 64
# configs of their own shape, outside the FAMILIES every structure test runs: OPT (its final norm registered before
# its layers, tokens flattened in its MLP), GPT-J (fc_in/fc_out/out_proj), Falcon (attention computed in the model,
# blocks that return tuples), Bloom (an embedding norm before its blocks, blocks that return tuples), Gemma 3 as
# published (Gemma3ForConditionalGeneration: a vision tower with layers of its own beside the language model)
OTHER_FAMILIES = ("opt", "gptj", "falcon", "bloom", "gemma3_vision")
WINDOW = 6  # sliding window of the families that have one (gemma2 and gemma3 alternate windowed and full layers)
WINDOWED = ("mistral", "gemma2", "gemma3")
FAMILIES = (
    "llama",
    "qwen2",
    "gpt2",
    "mistral",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "glm4",
    "olmo2",
    "stablelm",
    "granite",
)


def config(family: str, **overrides: Any) -> Any:
    """A config of `family` with 4 heads (2 key/value heads where the family has GQA) and no dropout."""
    if family == "gpt2":
        settings = dict(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=POSITIONS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
        )
        return transformers.GPT2Config(**{**settings, **overrides})
    if family in OTHER_FAMILIES or family == "codegen":
        return _other(family, overrides)
    classes = {
        "llama": "LlamaConfig",
        "qwen2": "Qwen2Config",
        "mistral": "MistralConfig",
        "qwen3": "Qwen3Config",
        "gemma": "GemmaConfig",
        "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig",
        "phi3": "Phi3Config",
        "glm4": "Glm4Config",  # a fused gate/up like Phi-3's, with q/k/v apart
        "olmo2": "Olmo2Config",
        "stablelm": "StableLmConfig",
        "granite": "GraniteConfig",
        "nemotron": "NemotronConfig",  # its LayerNorm1P (weight + 1), a norm by no name meshkit knew
    }
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=POSITIONS,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family in WINDOWED:  # a window shorter than the test sequences, so that it masks
        settings["sliding_window"] = WINDOW
    if family == "gemma3":
        settings["layer_types"] = ["sliding_attention", "full_attention"] * (LAYERS // 2)
    return getattr(transformers, classes[family])(**{**settings, **overrides})


def _other(family: str, overrides: dict[str, Any]) -> Any:
    """Families whose configs name their sizes otherwise (see OTHER_FAMILIES)."""
    if family == "opt":
        settings = dict(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, max_position_embeddings=POSITIONS, word_embed_proj_dim=HIDDEN,
                        dropout=0.0, enable_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
        return transformers.OPTConfig(**{**settings, **overrides})
    if family == "gptj":
        settings = dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=4,
                        n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)  # fmt: skip
        return transformers.GPTJConfig(**{**settings, **overrides})
    if family == "codegen":  # (q, v and k cut inside 4 fixed groups: 8 heads give each group 2, so tp=2 fits)
        settings = dict(vocab_size=VOCAB, n_embd=2 * HIDDEN, n_layer=2, n_head=8, rotary_dim=4, n_positions=POSITIONS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)  # fmt: skip
        return transformers.CodeGenConfig(**{**settings, **overrides})
    if family == "bloom":
        settings = dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, hidden_dropout=0.0,
                        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
        return transformers.BloomConfig(**{**settings, **overrides})
    if family == "gemma3_vision":
        overrides = dict(overrides)
        text = overrides.pop("text_config", None) or config("gemma3").to_dict()
        vision = dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=LAYERS + 2,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        )  # fmt: skip (more layers than the text: never taken for blocks)
        return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, **overrides)
    settings = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    new_decoder_architecture=True, num_kv_heads=KV_HEADS, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2)  # fmt: skip
    return transformers.FalconConfig(**{**settings, **overrides})


def causal_lm(family: str, seed: int = 0, **overrides: Any) -> Any:
    """`AutoModelForCausalLM.from_config` of the tiny config, in fp32 with a fixed seed."""
    import torch

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(family, **overrides), dtype=torch.float32)
