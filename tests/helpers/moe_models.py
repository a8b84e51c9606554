"""Tiny mixture-of-experts causal LMs built offline from configs: 4 experts, top-2, random init."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, EXPERTS, TOP_K = 64, 32, 4, 2, 2, 4, 2
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")
# families meshkit has no adapter entry for, each read from its shapes alone: OLMoE (q/k norms over whole
# projections), DeepSeek-V2 (latent attention, values narrower than keys), PhiMoE and HunYuan (routers named
# `router`, and a Linear inside `gate`), ERNIE 4.5 (a frozen correction bias in the router), GraniteMoE,
# Qwen3-Next (linear-attention layers beside attention) and Llama 4's text model (every token through every
# expert's rows, its shared expert's output added to in place, a base model not under its base_model_prefix),
# GraniteMoE-Shared (a fused input_linear/output_linear shared MLP beside the MoE block)
MORE_MOE_FAMILIES = ("olmoe", "deepseek_v2", "phimoe", "hunyuan_moe", "ernie4_5_moe", "granitemoe", "qwen3_next",
                     "llama4", "granitemoeshared")  # fmt: skip
# see moe_causal_lm
TEST_VARIANTS = ("mixtral_one_sided", "mixtral_aux", "qwen3_moe_aux", "qwen2_moe_aux", "gpt_oss", "deepseek_v3_q_lora",
                 "mixtral_aux_deep")  # fmt: skip
# (MoE blocks, shared experts, router loss coefficient) of each tiny model
EXPECTED = {
    "mixtral": (LAYERS, None, 0.001),
    "qwen3_moe": (LAYERS, None, 0.001),
    "qwen2_moe": (LAYERS, "shared_expert", 0.001),
    "deepseek_v3": (LAYERS - 1, "shared_experts", None),  # its first block is dense; no auxiliary loss
    "olmoe": (LAYERS, None, 0.01),
    "deepseek_v2": (LAYERS - 1, "shared_experts", None),
    "phimoe": (LAYERS, None, 0.001),
    "hunyuan_moe": (LAYERS, "shared_mlp", None),
    "ernie4_5_moe": (LAYERS, None, 0.001),
    "granitemoe": (LAYERS, None, 0.001),
    "qwen3_next": (LAYERS, "shared_expert", 0.001),
    "llama4": (LAYERS, "shared_expert", 0.001),
    "granitemoeshared": (LAYERS, None, 0.001),  # (its shared MLP sits beside the MoE block, a dense MLP to tp)
}


def moe_config(family: str, **overrides: Any) -> Any:
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_experts_per_tok=TOP_K,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if family == "mixtral":
        settings = dict(common, num_local_experts=EXPERTS)
        return transformers.MixtralConfig(**{**settings, **overrides})
    if family == "qwen3_moe":
        settings = dict(common, num_experts=EXPERTS, moe_intermediate_size=HIDDEN, decoder_sparse_step=1,
                        mlp_only_layers=[], head_dim=HIDDEN // HEADS)  # fmt: skip
        return transformers.Qwen3MoeConfig(**{**settings, **overrides})
    if family == "qwen2_moe":
        settings = dict(common, num_experts=EXPERTS, moe_intermediate_size=HIDDEN, decoder_sparse_step=1,
                        mlp_only_layers=[], shared_expert_intermediate_size=HIDDEN)  # fmt: skip
        return transformers.Qwen2MoeConfig(**{**settings, **overrides})
    if family == "deepseek_v3":
        settings = dict(common, num_key_value_heads=HEADS, n_routed_experts=EXPERTS, moe_intermediate_size=HIDDEN,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)  # fmt: skip
        return transformers.DeepseekV3Config(**{**settings, **overrides})
    if family == "gpt_oss":  # fused gate/up stored [E, H, 2·I] with biases beside them; sliding-window layers
        settings = dict(common, num_local_experts=EXPERTS, head_dim=HIDDEN // HEADS, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        return transformers.GptOssConfig(**{**settings, **overrides})
    more = _more_families(common)
    if family in more:
        config_class, settings = more[family]
        return config_class(**{**settings, **overrides})
    raise ValueError(family)


def _more_families(common: dict[str, Any]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Families with no adapter entry, each with what sets it apart (see MORE_MOE_FAMILIES)."""
    deepseek = dict(common, num_key_value_heads=HEADS, moe_intermediate_size=HIDDEN, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)  # fmt: skip
    return {
        "olmoe": (transformers.OlmoeConfig, dict(common, num_experts=EXPERTS)),
        "deepseek_v2": (transformers.DeepseekV2Config, dict(deepseek, n_routed_experts=EXPERTS)),
        "phimoe": (
            transformers.PhimoeConfig,
            dict(common, num_local_experts=EXPERTS, router_jitter_noise=0.0, input_jitter_noise=0.0),
        ),  # fmt: skip
        "hunyuan_moe": (
            transformers.HunYuanMoEV1Config,
            dict(common, num_experts=EXPERTS, moe_topk=TOP_K, head_dim=HIDDEN // HEADS),
        ),  # fmt: skip
        "ernie4_5_moe": (
            transformers.Ernie4_5_MoeConfig,
            dict(
                common,
                moe_num_experts=EXPERTS,
                moe_k=TOP_K,
                moe_intermediate_size=HIDDEN,
                moe_layer_start_index=0,
                moe_num_shared_experts=0,
            ),
        ),  # fmt: skip
        "granitemoe": (transformers.GraniteMoeConfig, dict(common, num_local_experts=EXPERTS)),
        "granitemoeshared": (
            transformers.GraniteMoeSharedConfig,
            dict(common, num_local_experts=EXPERTS, shared_intermediate_size=HIDDEN),
        ),  # fmt: skip
        # every token through every expert's rows (routing weights on the inputs), a shared expert added in place
        "llama4": (
            transformers.Llama4TextConfig,
            dict(
                common,
                intermediate_size=HIDDEN,
                intermediate_size_mlp=2 * HIDDEN,
                num_local_experts=EXPERTS,
                head_dim=HIDDEN // HEADS,
                interleave_moe_layer_step=1,
                attention_chunk_size=64,
            ),
        ),  # fmt: skip
        "qwen3_next": (
            transformers.Qwen3NextConfig,
            dict(
                common,
                num_experts=EXPERTS,
                moe_intermediate_size=HIDDEN,
                shared_expert_intermediate_size=HIDDEN,
                head_dim=HIDDEN // HEADS,
                linear_num_value_heads=2,
                linear_num_key_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                layer_types=["linear_attention", "full_attention"],
            ),
        ),  # fmt: skip
    }


LOW_RANK_QUERY = "deepseek_v3_q_lora"
ONE_SIDED = "mixtral_one_sided"  # Mixtral whose routers send every token to the same two experts at first
# "<family>_aux": the same model with the router's balancing loss on (a coefficient large enough to matter)
WITH_ROUTER_LOSS = {"mixtral_aux": "mixtral", "qwen3_moe_aux": "qwen3_moe", "qwen2_moe_aux": "qwen2_moe"}
DEEP = "mixtral_aux_deep"  # mixtral_aux with 4 blocks: 2 stages per rank of a pp 2 pipeline
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.1)


def moe_causal_lm(family: str, seed: int = 0, **overrides: Any) -> Any:
    import torch

    if family == DEEP:
        family, overrides = "mixtral", {**ROUTER_LOSS, "num_hidden_layers": 4, **overrides}
    if family in WITH_ROUTER_LOSS:
        family, overrides = WITH_ROUTER_LOSS[family], {**ROUTER_LOSS, **overrides}
    if family == LOW_RANK_QUERY:  # DeepSeek-V3 as released: the query through a low-rank projection too
        family, overrides = "deepseek_v3", {"q_lora_rank": 16, **overrides}
    one_sided = family == ONE_SIDED
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        moe_config("mixtral" if one_sided else family, **overrides), dtype=torch.float32
    )
    if one_sided:  # every router starts at zero, so ties choose the same experts and the others get no token;
        # the loop over experts (eager) leaves an expert without tokens out of the graph altogether
        model.config._experts_implementation = "eager"
        for layer in model.model.layers:
            torch.nn.init.zeros_(layer.mlp.gate.weight)
    return model


def save_mxfp4_gpt_oss(out: Any, tokenizer: Any = None, **overrides: Any) -> list[str]:
    """A tiny gpt-oss saved as released, its expert banks in MXFP4 (packed 4-bit `_blocks`, one exponent per 32
    values in `_scales`, random) with `quantization_config` saying so; returns the banks' model names."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out)
    moe_causal_lm("gpt_oss", seed=3, **overrides).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    banks = [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for name in banks:
        experts, inputs, outputs = tensors.pop(name).shape  # packed along the inputs, one row per output
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=generator)
        tensors[f"{name}_blocks"] = blocks
        tensors[f"{name}_scales"] = torch.randint(118, 124, blocks.shape[:-1], dtype=torch.uint8, generator=generator)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    settings = json.loads((out / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(settings))
    return banks
