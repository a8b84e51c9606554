"""Tiny random models of any transformers model type, made offline: a generic shrinker over a config's standard
size attributes (hidden size, layers, heads, experts, ...), and the hub names Axolotl's examples use mapped to the
model type their checkpoints hold. Used by the benches that sweep models (`bench/axolotl_examples.py`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

# the size attributes a config may have, and the tiny value each takes (only those the config has are set)
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 512,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_group": 1,
    "topk_group": 1,
}

# fragments of hub names (lower case) -> the model type the checkpoint's config.json names; first match wins
HUB_TYPES: tuple[tuple[str, str], ...] = (
    ("qwen3-next", "qwen3_next"),
    ("qwen3-30b-a3b", "qwen3_moe"),
    ("qwen3-235b", "qwen3_moe"),
    ("qwen3-coder-30b", "qwen3_moe"),
    ("qwen3", "qwen3"),
    ("qwen1.5-moe", "qwen2_moe"),
    ("qwen2-moe", "qwen2_moe"),
    ("qwen", "qwen2"),
    ("skywork-reward-v2-qwen3", "qwen3"),
    ("llama-4", "llama4_text"),
    ("mixtral", "mixtral"),
    ("mistral", "mistral"),
    ("ministral", "mistral"),
    ("magistral", "mistral"),
    ("devstral", "mistral"),
    ("gemma-3n", "gemma3n_text"),
    ("gemma-3", "gemma3_text"),
    ("gemma-2", "gemma2"),
    ("gemma", "gemma"),
    ("phi-3", "phi3"),
    ("phi-4", "phi3"),
    ("phi-1", "phi"),
    ("phi-2", "phi"),
    ("falcon-h1", "falcon_h1"),
    ("falcon", "falcon"),
    ("gpt-oss", "gpt_oss"),
    ("dbrx", "dbrx"),
    ("jamba", "jamba"),
    ("lfm2-8b-a1b", "lfm2_moe"),
    ("lfm2", "lfm2"),
    ("stablelm", "stablelm"),
    ("pythia", "gpt_neox"),
    ("starcoder2", "starcoder2"),
    ("deepseek-v2", "deepseek_v2"),
    ("deepseek-coder-v2", "deepseek_v2"),
    ("deepseek-v3", "deepseek_v3"),
    ("deepseek-v4", "deepseek_v4"),
    ("deepcoder", "qwen2"),
    ("deepseek-r1", "deepseek_v3"),
    ("olmo", "olmo2"),
    ("granite", "granite"),
    ("seed-oss", "seed_oss"),
    ("glm-4", "glm4"),
    ("glm-5", "glm_moe_dsa"),
    ("apertus", "apertus"),
    ("afm-4.5b", "arcee"),
    ("trinity", "afmoe"),
    ("cerebras-gpt", "gpt2"),
    ("gpt-j", "gptj"),
    ("mpt-", "mpt"),
    ("redpajama", "gpt_neox"),
    ("command-r7b", "cohere2"),
    ("c4ai-command-r", "cohere"),
    ("hunyuan", "hunyuan_v1_dense"),
    ("kimi-linear", "kimi_linear"),
    ("mamba", "mamba"),
    ("minimax-m2", "minimax_m2"),
    ("nemotron-mini", "nemotron"),
    ("nemotron-3", "nemotron_h"),
    ("orpheus", "llama"),
    ("plano", "qwen3"),
    ("smollm", "llama"),
    ("tinyllama", "llama"),
    ("llama", "llama"),
    ("yi-", "llama"),
    ("xgen", "llama"),
)


def hub_type(name: str) -> str | None:
    """The model type behind a hub name (None when the table does not know it)."""
    lowered = name.lower()
    return next((kind for fragment, kind in HUB_TYPES if fragment in lowered), None)


def tiny_config(model_type: str, vocab_size: int, **overrides: Any) -> Any:
    """The default config of `model_type` shrunk: every size attribute it has set to TINY_SIZES', the vocabulary to
    `vocab_size`, per-layer lists cut to the layer count, dropout off."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    sizes = dict(TINY_SIZES)
    if getattr(config, "num_key_value_heads", None) == getattr(config, "num_attention_heads", 0):
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]  # multi-head (MLA, e.g.) stays so
    for name, value in {**sizes, "vocab_size": vocab_size, **overrides}.items():
        if hasattr(config, name):
            _set(config, name, value)
    layers = getattr(config, "num_hidden_layers", None)
    for name in ("layer_types", "layers_block_type", "mlp_only_layers"):
        value = getattr(config, name, None)
        if isinstance(value, list) and layers:
            _set(config, name, (value * layers)[:layers] if value else value)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
        if isinstance(getattr(config, name, None), float):
            _set(config, name, 0.0)
    return config


def _set(config: Any, name: str, value: Any) -> None:
    with contextlib.suppress(AttributeError):  # a derived property (computed from other sizes): the config's
        setattr(config, name, value)


def save_tiny_model(model_type: str, tokenizer: Any, out: Path, head: str = "AutoModelForCausalLM") -> Path:
    """A tiny random `head` model of `model_type` with `tokenizer`, written in save_pretrained layout."""
    import torch
    import transformers

    config = tiny_config(model_type, len(tokenizer))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    torch.manual_seed(0)
    model = getattr(transformers, head).from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
