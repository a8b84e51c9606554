"""Memory per device for a model, a layout and a workload: `meshkit estimate` and `estimate_memory()`.

Model states follow the ZeRO paper (Rajbhandari et al., 2020): with mixed precision and Adam every parameter
costs 2 bytes (16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master copy, momentum, variance) = 16Ψ,
and ZeRO stages 1, 2, 3 divide the optimizer states, then the gradients, then the weights by the number of
data-parallel ranks Nd. In fp32 the bytes are 4 + 4 + 8. Tensor and pipeline parallel divide Ψ first.

Activations: for a decoder whose widths are known (GQA, gated MLP, routed experts), as its modules save them
(`activation_estimate.decoder_layer_activation_bytes`, checked against measured saved tensors); otherwise
Korthikanti et al., 2022 ("Reducing Activation Recomputation in Large Transformer Models"): per layer
sbh(34 + 5as/h) bytes at 16 bits with dropout, of which 32sbh + 4as²b are 16-bit values and 2sbh + as²b are
1-byte dropout masks. The values scale with the element size (4 bytes in fp32), the masks
vanish without dropout; tensor parallel divides 24 of the 34 (all of it with sequence parallel) and the
attention scores; selective recompute drops the attention-score term; full recompute keeps only each layer's
input (2sbh). Context parallel divides the sequence. A pipeline's first stage holds `pp` micro-batches of its
L/pp layers (1F1B), i.e. L layers' worth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshkit.config.layout import Offload, Recompute
from meshkit.core.errors import MeshkitError
from meshkit.parallel.zero import BUCKETS_IN_FLIGHT
from meshkit.planning.activation_estimate import (  # noqa: F401 - layer_activation_bytes re-exported
    activation_line,
    decoder_layer_activation_bytes,
    layer_activation_bytes,
)

GB = 1e9
Precision = Literal["fp32", "bf16", "fp16"]
Optimizer = Literal["adam", "adam8bit", "adam4bit", "sgd"]


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


@dataclass(frozen=True)
class Line:
    name: str
    gb: float
    formula: str


@dataclass
class Estimate:
    """The lines, and how they meet at the peak. Gradients that `zero_grad()` frees every step and backward
    builds again (ZeRO-2/3 shards, a pipeline's, a single device's) grow while the activations are freed, so the
    peak holds the larger of the two; gradients in a buffer kept across steps (DDP's buckets as gradients, ZeRO-1's
    full buffer, allocated as backward starts) are there with all the activations."""

    lines: list[Line] = field(default_factory=list)
    grads_meet_activations: bool = True
    host_gb: float = 0.0  # per rank, in host memory (offloaded optimizer states); not in the device total

    def gb(self, name: str) -> float:
        return sum(line.gb for line in self.lines if line.name == name)

    @property
    def total_gb(self) -> float:
        total = sum(line.gb for line in self.lines)
        if self.grads_meet_activations:
            return total
        grads, activations = self.gb("grads"), self.gb("activations")
        return total - grads - activations + max(grads, activations)

    @property
    def total_formula(self) -> str:
        return "sum" if self.grads_meet_activations else "sum, with max(grads, activations) for the two"

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{line.name}_gb": line.gb for line in self.lines}
        out["total_gb"] = self.total_gb
        out["formulas"] = {line.name: line.formula for line in self.lines}
        out["formulas"]["total"] = self.total_formula
        return out


Reference = Literal["none", "copy", "adapters", "precomputed"]  # preference training's reference model


def model_state_bytes(precision: Precision, optimizer: Optimizer) -> tuple[int, int, int]:
    """Bytes per parameter for (weights, gradients, optimizer states)."""
    mixed = precision != "fp32"
    # adam8bit: two 1-byte moments (bitsandbytes, torchao); adam4bit: two half-byte moments (torchao); the block
    # scales (4 bytes per 128-256 values) are left out
    moments = {"adam": 8, "adam8bit": 2, "adam4bit": 1}.get(optimizer, 4)
    if mixed:
        return 2, 2, 4 + moments  # fp32 master weights kept by the optimizer
    return 4, 4, moments


def estimate_memory(
    model: ModelShape,
    *,
    seq_len: int = 2048,
    micro_batch: int = 1,
    precision: Precision = "bf16",
    optimizer: Optimizer = "adam",
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    activation_checkpointing: Recompute = "none",
    offload: Offload = "none",
    sequence_parallel: bool | None = None,
    dropout: bool = False,
    gradient_as_bucket_view: bool = False,
    zero_bucket_mb: float = 25.0,
    runtime_gb: float = 0.0,
    ep: int = 1,
    reference: Reference = "none",
) -> Estimate:
    """Per-device GB (10^9 bytes) for params, grads, optimizer, activations, buffers and the runtime, with
    formulas. `runtime_gb` is what the process holds outside tensors (measured: torch's kernels and the
    distributed runtime on a CPU rank, 17-23 MB; on a GPU the CUDA context and library workspaces).
    A mixture of experts keeps its routed experts whole under tp; `ep` splits them, and ZeRO-3 shards each
    rank's experts over the dp·cp/ep ranks that hold the same ones. `reference` (preference training): "copy" adds
    a frozen copy of the weights laid out like the policy's (split by tp/pp, sharded under ZeRO-3; no gradients,
    no optimizer state); "adapters" (LoRA's base with adapters off) and "precomputed" add nothing — pass the
    micro-batch in rows (a pair is two)."""
    _check_layout(model, zero_stage, dp, tp, pp, cp, ep)
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    weight_b, grad_b, optim_b = model_state_bytes(precision, optimizer)
    dense, experts = model.local_params(tp, pp, ep)
    local = dense + experts  # parameters this device owns before ZeRO
    shards = dp * cp  # ZeRO/FSDP shards over the data-parallel (and context-parallel) ranks

    def sharded(stage: int) -> float:  # parameters left per rank when ZeRO stage `stage` shards them
        return dense / shards + experts / (shards // ep) if zero_stage >= stage else local

    nd = f"Nd={shards}"
    psi = f"Ψ/(tp·pp)={local:.4g}"
    if model.expert_params:
        psi = f"(Ψdense/(tp·pp) + Ψexperts/(ep·pp))={local:.4g}"
        nd += f", experts over Nd/ep={shards // ep}"
    params = weight_b * sharded(3)
    grads = grad_b * sharded(2)
    optim = optim_b * sharded(1)
    lines = [
        Line("params", params / GB, f"{weight_b}·{psi}" + (f"/{nd} (ZeRO-3)" if zero_stage >= 3 else "")),
        Line("grads", grads / GB, f"{grad_b}·{psi}" + (f"/{nd} (ZeRO-2+)" if zero_stage >= 2 else "")),
    ]
    if offload != "none":
        lines.append(Line("optimizer", 0.0, f"{optim_b}·Ψ' offloaded to {offload}: {optim / GB:.3g} GB off device"))
    else:
        lines.append(Line("optimizer", optim / GB, f"{optim_b}·{psi}" + (f"/{nd} (ZeRO-1+)" if zero_stage else "")))
    if reference == "copy":
        lines.append(
            Line(
                "reference",
                params / GB,
                f"a frozen copy: {weight_b}·{psi}" + (f"/{nd} (ZeRO-3)" if zero_stage >= 3 else ""),
            )
        )  # noqa: E501
    elif reference != "none":
        lines.append(Line("reference", 0.0, f"{reference}: no second copy of the weights"))
    activations, formula = activation_line(
        model, seq_len, micro_batch, precision, tp, pp, cp, sp, activation_checkpointing, dropout, zero_stage
    )
    lines.append(Line("activations", activations / GB, formula))
    full_grads = grad_b * local
    bucket = full_grads if zero_stage == 0 and not gradient_as_bucket_view else 0.0
    if zero_stage == 2 and shards > 1:  # buckets in flight during backward, each within one rank's chunk
        bucket = BUCKETS_IN_FLIGHT * min(zero_bucket_mb * 1e6, grads)
    lines.append(_buffers(model, zero_stage, dp, cp, tp, weight_b, bucket, ep))
    lines.append(Line("runtime", runtime_gb, "given" if runtime_gb else "not counted (runtime_gb / --runtime-gb)"))
    kept = pp == 1 and shards > 1 and (zero_stage == 1 or zero_stage == 0 and gradient_as_bucket_view)
    host = optim / GB if offload == "cpu" else 0.0
    return Estimate(lines, grads_meet_activations=kept, host_gb=host)


def _buffers(
    model: ModelShape, zero_stage: int, dp: int, cp: int, tp: int, weight_b: int, bucket: float, ep: int = 1
) -> Line:
    if zero_stage >= 3:
        layer = model.largest_layer_params or model.params / max(1, model.layers or 1)
        if model.moe_layers:  # an MoE block: its dense part split by tp, its experts (kept whole by tp) by ep
            bank = model.expert_params / model.moe_layers
            per_rank = (layer - bank) / tp + bank / ep
            gathered = 2 * weight_b * per_rank
            formula = f"2 gathered layers: 2·{weight_b}·((block − experts)/tp + experts/ep)={per_rank:.4g}"
            return Line("buffers", gathered / GB, formula)
        gathered = 2 * weight_b * layer / tp  # the layer in use and the one prefetched
        return Line("buffers", gathered / GB, f"2 gathered layers: 2·{weight_b}·{layer:.4g}/tp")
    if dp * cp > 1 and zero_stage == 0 and bucket:
        return Line("buffers", bucket / GB, "DDP gradient buckets: a copy of the gradients")
    if dp * cp > 1 and zero_stage == 2:
        return Line("buffers", bucket / GB, f"{BUCKETS_IN_FLIGHT} reduction buckets of min(zero.bucket_mb, 4Ψ/Nd)")
    return Line("buffers", 0.0, "none")


def _check_layout(model: ModelShape, zero_stage: int, dp: int, tp: int, pp: int, cp: int, ep: int = 1) -> None:
    if not 0 <= zero_stage <= 3:
        raise EstimateError(f"zero_stage={zero_stage}: choose 0, 1, 2 or 3")
    for name, size in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if size < 1:
            raise EstimateError(f"{name}={size}: sizes are 1 or more")
    if ep > 1 and ((dp * cp) % ep or (model.experts and model.experts % ep)):
        raise EstimateError(f"ep={ep} must divide dp·cp={dp * cp} and the {model.experts or '?'} experts")
    if model.heads is not None and (tp > model.heads or model.heads % tp):
        raise EstimateError(f"tp={tp} does not divide the {model.heads} attention heads")
    if model.layers is not None and pp > model.layers:
        raise EstimateError(f"pp={pp} is more than the {model.layers} layers: a stage would be empty")
    if model.params <= 0:
        raise EstimateError("the model has no parameters: give --params or a model config")


def as_table_rows(estimate: Estimate) -> list[tuple[str, str, str]]:
    rows = [(line.name, f"{line.gb:.3f}", line.formula) for line in estimate.lines]
    return [*rows, ("total", f"{estimate.total_gb:.3f}", estimate.total_formula)]
