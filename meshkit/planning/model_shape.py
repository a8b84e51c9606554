"""What the estimator and the planner need of a model: Ψ and the transformer's widths (`ModelShape`), from a
Hugging Face config.json, the reference GPT's config, or given numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshkit.core.errors import MeshkitError


class EstimateError(MeshkitError):
    """Inputs the estimator cannot use; the message says which and why."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: Ψ, and the transformer shape for activations (None: unknown)."""

    params: float
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    largest_layer_params: float | None = None  # one block: what ZeRO-3 gathers at a time
    kv_heads: int | None = None  # grouped-query attention: K/V heads (None: as many as heads)
    expert_params: float = 0.0  # mixture of experts: every routed expert's parameters, all layers (in `params`)
    active_expert_fraction: float = 1.0  # top-k / experts: the share of the experts a token passes through
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    top_k: int = 0  # experts each token is routed to
    moe_layers: int = 0  # blocks with an expert bank
    router_loss: bool = False  # the config turns the router's balancing loss on (`output_router_logits`)
    ffn: int | None = None  # a gated (SwiGLU) MLP's width; None: a 4h GELU MLP (Korthikanti's activation count)
    expert_ffn: int | None = None  # each routed expert's gated MLP width
    fused_attention: bool = True  # SDPA's fused kernels (flash, memory-efficient, cuDNN) keep no attention scores

    def local_params(self, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[float, float]:
        """(dense, expert) parameters one rank holds before ZeRO: tensor parallel splits the dense ones, expert
        parallel the routed experts (tensor parallel keeps each expert bank whole)."""
        return (self.params - self.expert_params) / (tp * pp), self.expert_params / (ep * pp)

    def zero3_unit_params(self, tp: int = 1, stored_bytes: int = 4, unit_mb: float = 25.0) -> float:
        """Parameters one ZeRO-3 (FSDP) unit gathers at once: consecutive blocks (split by tp) grouped up to
        `unit_mb` of stored weights, a bigger block alone (`sharding.unit_mb`, as meshkit.parallel.fsdp groups)."""
        block = (self.largest_layer_params or self.params / max(1, self.layers or 1)) / tp
        if block <= 0:
            return 0.0
        per_unit = max(1, int(unit_mb * 1e6 // (stored_bytes * block)))
        return block * min(per_unit, self.layers or 1)

    @property
    def active_params(self) -> float:
        """Parameters a token passes through (what compute scales with); = params for a dense model."""
        return self.params - self.expert_params * (1.0 - self.active_expert_fraction)

    @classmethod
    def transformer(
        cls, *, layers: int, hidden: int, heads: int, vocab: int, ffn: int | None = None, kv_heads: int | None = None
    ) -> ModelShape:
        """A Llama-style decoder (gated MLP when `ffn` is given, else a 4h GELU MLP), untied head."""
        head_dim = hidden // heads
        attention = 2 * hidden * hidden + 2 * hidden * head_dim * (kv_heads or heads)
        mlp = 3 * hidden * ffn if ffn else 8 * hidden * hidden
        block = attention + mlp + 2 * hidden
        return cls(
            params=float(layers * block + 2 * vocab * hidden + hidden),
            layers=layers,
            hidden=hidden,
            heads=heads,
            vocab=vocab,
            largest_layer_params=float(block),
            kv_heads=kv_heads,
            ffn=ffn,
        )

    @classmethod
    def from_gpt(cls, config: Any) -> ModelShape:
        """The reference GPT (`meshkit.models.gpt.GPTConfig`)."""
        return cls.transformer(
            layers=config.n_layers,
            hidden=config.dim,
            heads=config.n_heads,
            vocab=config.vocab_size,
            ffn=config.hidden,
            kv_heads=config.kv_heads,
        )

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelShape:
        config = json.loads(Path(path).read_text())
        needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [key for key in needed if key not in config]
        if missing:
            raise EstimateError(f"{path}: the Hugging Face config lacks {', '.join(missing)}")
        if moe_experts(config):
            return moe_shape(config)
        return cls.transformer(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=config["num_attention_heads"],
            vocab=config["vocab_size"],
            ffn=config.get("intermediate_size"),
            kv_heads=config.get("num_key_value_heads"),
        )


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def moe_experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer in a Hugging Face config (0: a dense model)."""
    return next((int(config[key]) for key in EXPERT_COUNT_KEYS if config.get(key)), 0)


def moe_shape(config: dict[str, Any]) -> ModelShape:
    """A mixture-of-experts decoder from its Hugging Face config: attention as `transformer`, then per layer a
    router [E, h] and E gated experts of `moe_intermediate_size` (else `intermediate_size`), plus shared experts
    (DeepSeek's `n_shared_experts`, Qwen2-MoE's `shared_expert_intermediate_size` and its gate); layers before
    `first_k_dense_replace`, in `mlp_only_layers` or off `decoder_sparse_step` keep a dense MLP."""
    layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    experts, top_k = moe_experts(config), int(config.get("num_experts_per_tok") or 1)
    dense_ffn = config.get("intermediate_size") or 4 * hidden
    expert_ffn = config.get("moe_intermediate_size") or dense_ffn
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * heads * head_dim * 2 + 2 * hidden * head_dim * (kv_heads or heads)
    shared = 3 * hidden * expert_ffn * int(config.get("n_shared_experts") or 0)
    if config.get("shared_expert_intermediate_size"):
        shared += 3 * hidden * config["shared_expert_intermediate_size"] + hidden  # and its sigmoid gate
    dense_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    first_moe = int(config.get("first_k_dense_replace") or 0)
    moe_layers = [i for i in range(layers) if i >= first_moe and i not in dense_only and (i + 1) % step == 0]
    bank = experts * 3 * hidden * expert_ffn
    moe_block = attention + experts * hidden + bank + shared + 2 * hidden
    dense_block = attention + 3 * hidden * dense_ffn + 2 * hidden
    blocks = len(moe_layers) * moe_block + (layers - len(moe_layers)) * dense_block
    embeddings = (1 if config.get("tie_word_embeddings") else 2) * vocab * hidden
    return ModelShape(
        params=float(blocks + embeddings + hidden),
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        largest_layer_params=float(max(moe_block, dense_block) if moe_layers else dense_block),
        kv_heads=kv_heads,
        expert_params=float(len(moe_layers) * bank),
        active_expert_fraction=min(1.0, top_k / experts),
        experts=experts,
        top_k=top_k,
        moe_layers=len(moe_layers),
        ffn=dense_ffn,
        expert_ffn=expert_ffn,
        router_loss=bool(config.get("output_router_logits")) and float(config.get("router_aux_loss_coef") or 0) > 0,
    )
