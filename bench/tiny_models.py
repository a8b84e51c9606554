"""Tiny random models of any transformers model type, made offline: a generic shrinker over a config's standard
size attributes (hidden size, layers, heads, experts, ...), and the hub names Axolotl's examples use mapped to the
model type their checkpoints hold. Used by the benches that sweep models (`bench/axolotl_examples.py`).
"""

from __future__ import annotations

import re
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
    "num_kv_shared_layers": 0,  # (Gemma-3n/4: later layers reuse earlier layers' caches)
    "rotary_dim": 4,  # (GPT-J, CodeGen: rotary on part of each head, at most its size)
    # vision and audio towers of a multimodal checkpoint (built, never run by text data)
    "vision_output_dim": 32,
    "projector_input_dim": 32,
    "projector_output_dim": 32,
    "out_hidden_size": 32,
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
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
    ("llama-4", "llama4"),
    ("mixtral", "mixtral"),
    ("voxtral", "voxtral"),
    ("mistral-small-4", "mistral3"),
    ("mistral-medium-3", "mistral3"),
    ("mistral", "mistral"),
    ("ministral", "mistral"),
    ("magistral", "mistral"),
    ("devstral", "mistral"),
    ("gemma-3n", "gemma3n_text"),
    ("gemma-3-1b", "gemma3_text"),
    ("gemma-3-270m", "gemma3_text"),
    ("gemma-3", "gemma3"),
    ("gemma-4", "gemma4"),
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
    `vocab_size`, per-layer lists cut to the layer count (each kind of layer kept, with its per-layer sizes), dropout
    and router jitter off; a multimodal config's text, vision and audio configs each shrunk so."""
    from transformers import AutoConfig

    values = AutoConfig.for_model(model_type).to_dict()
    shrunk = _shrunk(values, {**TINY_SIZES, "vocab_size": vocab_size, "vocab_size_per_layer_input": vocab_size,
                              "hidden_size_per_layer_input": 8, **overrides})  # fmt: skip
    shrunk.pop("model_type", None)
    return AutoConfig.for_model(model_type, **shrunk)


def _shrunk(values: dict[str, Any], sizes: dict[str, Any]) -> dict[str, Any]:
    from transformers import CONFIG_MAPPING

    out = {k: _shrunk(v, sizes) if isinstance(v, dict) and "model_type" in v else v for k, v in values.items()}
    kind = values.get("model_type")
    aliases = getattr(CONFIG_MAPPING[kind], "attribute_map", {}) if kind in CONFIG_MAPPING else {}
    heads, kv_heads = (aliases.get(name, name) for name in ("num_attention_heads", "num_key_value_heads"))
    if kv_heads in out and out[kv_heads] is None and isinstance(out.get(heads), int):
        out[kv_heads] = out[heads]  # (None: as many as the query heads — Nemotron's default — said outright)
    if out.get(kv_heads) == out.get(heads):
        sizes = {**sizes, "num_key_value_heads": sizes["num_attention_heads"]}  # multi-head (MLA, e.g.) stays so
    sizes = {aliases.get(name, name): value for name, value in sizes.items()}  # (GPT-J's n_embd for hidden_size)
    out.update({name: value for name, value in sizes.items() if isinstance(out.get(name), int)})
    for name, value in list(out.items()):  # sizes of a family's own kind (a linear attention's heads, ...)
        if not isinstance(value, int) or isinstance(value, bool) or name in sizes:
            continue
        if re.search(r"(^|_)(num_\w*heads|n_\w*heads|\w*_num_heads)$", name) and value > 4:
            out[name] = 4
        elif name.endswith("head_dim") and value > 8:
            out[name] = 8
    if all(isinstance(out.get(name), int) for name in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")):
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]  # (MLA: the sum of its parts)
    layers = out.get("num_hidden_layers")
    kinds_of = values.get("layer_types")
    for name, value in list(out.items()):  # anything given per layer (Gemma-3n's sparsity), cut to the tiny layers
        if layers and isinstance(value, list) and len(value) == values.get("num_hidden_layers"):
            out[name] = [sizes[name]] * layers if name in sizes else value[:layers]
    for name in ("layer_types", "layers_block_type", "mlp_only_layers"):
        value = values.get(name)  # (the original list: every kind of layer it has is kept, each at least once)
        if isinstance(value, list) and value and layers:
            kinds = list(dict.fromkeys(value)) if all(isinstance(v, str) for v in value) else value
            out[name] = (kinds * layers)[:layers] if len(kinds) <= layers else value[:layers]
    if isinstance(out.get("full_attn_idxs"), list) and isinstance(out.get("layer_types"), list):  # LFM2: both say it
        out["full_attn_idxs"] = [i for i, kind in enumerate(out["layer_types"]) if kind == "full_attention"]
    for name in ("attn_layer", "expert_layer"):  # Jamba: every period-th layer from offset on; tiny: every other
        if isinstance(out.get(f"{name}_period"), int) and layers and layers >= 2:
            out[f"{name}_period"], out[f"{name}_offset"] = 2, 1
    if isinstance(out.get("per_layer_config"), dict) and isinstance(kinds_of, list) and layers:
        out["per_layer_config"] = _per_layer(values, out, sizes)
    for name, value in list(out.items()):  # no randomness: dropout of any name, a router's jitter noise (PhiMoE)
        if isinstance(value, float) and re.search(r"drop|jitter", name):
            out[name] = 0.0
    if all(isinstance(out.get(name), int) for name in ("mamba_d_head", "mamba_n_heads", "mamba_expand", "hidden_size")):
        out["mamba_d_head"] = out["mamba_expand"] * out["hidden_size"] // out["mamba_n_heads"]  # (Bamba: must fit)
    return out


def _per_layer(values: dict[str, Any], out: dict[str, Any], sizes: dict[str, Any]) -> dict[str, Any]:
    """Per-layer overrides for the tiny layers: each takes the first original layer of its kind's, its sizes scaled
    as the global ones were (Gemma 4's full-attention layers: twice the head size)."""
    originals = {int(index): entry for index, entry in values["per_layer_config"].items()}
    first_of = {}
    for index, kind in enumerate(values["layer_types"]):
        first_of.setdefault(kind, originals.get(index))
    tiny = {}
    for index, kind in enumerate(out["layer_types"]):
        entry = first_of.get(kind)
        if entry:
            tiny[str(index)] = {
                name: max(1, value * out[name] // values[name])
                if isinstance(value, int) and isinstance(values.get(name), int) and name in sizes else value
                for name, value in entry.items()
            }  # fmt: skip
    return tiny


def save_tiny_model(model_type: str, tokenizer: Any, out: Path, head: str = "AutoModelForCausalLM") -> Path:
    """A tiny random `head` model of `model_type` with `tokenizer`, written in save_pretrained layout."""
    import torch
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type, len(tokenizer))
    for part in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            setattr(part, name, getattr(tokenizer, name))
    if head == "AutoModelForCausalLM" and (model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or
                                           getattr(config, "vision_config", None) is not None):  # fmt: skip
        head = "AutoModelForImageTextToText"  # a multimodal checkpoint, as published (vision tower and all)
        if model_type not in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:  # (audio-text: Voxtral)
            head = modeling_auto.__dict__.get("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {}).get(model_type, head)
    torch.manual_seed(0)
    made = getattr(transformers, head)
    model = made.from_config(config, dtype=torch.float32) if head.startswith("Auto") else made(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
