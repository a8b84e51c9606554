"""The facts `models/structure.py` answers about a model, as plain frozen records (no model code here).

Kept apart from `describe()` so the family adapters (`hf_adapter.py`) and the structure layer both build them
without importing each other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from meshkit.core.errors import MeshkitError

HEAD_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "num_attention_heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")

# How a pipeline stage runs the model's own forward:
#   skip_none  — the model skips first/last-stage modules set to None (the reference GPT, user overrides)
#   sequential — the model is the block container: a stage is the same Sequential with other blocks skipped
#   hf         — a transformers model: stand-ins for the other stages' modules, hidden states handed in and out
StageStyle = Literal["skip_none", "sequential", "hf"]


class StructureError(MeshkitError):
    """A fact a strategy needs cannot be inferred from the model; the message names the override."""


@dataclass(frozen=True)
class AttentionFacts:
    path: str  # dotted module name
    heads: int | None  # query heads
    kv_heads: int | None  # key/value heads (GQA/MQA); = heads for plain multi-head attention
    head_dim: int | None
    # latent attention (DeepSeek's MLA): the projection whose output ends in a rotary key shared by every head,
    # and that key's width; the layers before the per-head ones stay whole, their gradients whole on every tp rank
    latent: str | None = None
    rotary_width: int = 0
    # norms over a whole projection's output, all heads at once (OLMo-2's q_norm/k_norm; Qwen3's norm each head
    # alone and are not listed): under tp they are split with the heads and take their statistics over tp
    projection_norms: tuple[str, ...] = ()
    # the attention's own parameters with a row per head (gpt-oss' and Flint's attention sinks, Doge's `A`): under
    # tp each rank keeps its heads' rows
    head_parameters: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertFacts:
    """One mixture-of-experts block: a router picks `top_k` of `experts` expert MLPs for each token."""

    path: str  # dotted module name of the MoE block (e.g. model.layers.3.mlp)
    router: str  # its router's name, relative to the block (gate, router)
    bank: str  # the expert bank, relative to the block (experts)
    experts: int
    top_k: int | None  # None: the model's config does not say
    fused: bool  # True: one 3-D tensor per projection, experts first (transformers 5); False: a list of MLPs
    bank_parameters: tuple[str, ...]  # the bank's parameters, relative to the block (experts.gate_up_proj, ...)
    shared: str | None = None  # shared expert(s) every token passes through (DeepSeek, Qwen2-MoE), if any
    adapted: bool = False  # the bank's parameters carry adapters (peft's LoRA on parameters wraps the bank)
    uneven: bool = False  # its tensors hold different expert counts (LongCat: rows for zero-computation experts)


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing (auxiliary) loss the model adds when asked: coefficient and the switch that asks."""

    coefficient: float
    switch: str | None  # the config attribute that turns it on (output_router_logits), None: always on
    enabled: bool = True  # the switch's value when the model was described: the model returns router logits


# transformers class names of models whose forward gives next-token logits (a multimodal model trained on text,
# Gemma 3's ForConditionalGeneration, included; an encoder-decoder's is told apart by its config)
CAUSAL_LM_CLASSES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


@dataclass(frozen=True)
class ModelStructure:
    family: str  # "gpt" (reference), a transformers model_type ("llama", "gpt2", ...), or "generic"
    blocks: str | None  # dotted path of the block container; '' = the model itself; None = none found
    first_stage: tuple[str, ...] = ()  # modules only the first pipeline stage holds
    last_stage: tuple[str, ...] = ()  # modules only the last pipeline stage holds
    stage_style: StageStyle | None = None  # None: the model cannot be split into pipeline stages as is
    attention: tuple[AttentionFacts, ...] = ()
    position_argument: str | None = None  # forward keyword that takes global token positions
    tied: tuple[tuple[str, ...], ...] = ()  # parameter names that share one tensor
    causal_lm: bool = False  # forward returns next-token logits (with .logits / a tensor)
    # a classification model's head (its per-token scores, before any pooling: a reward model's `score`), and whether
    # the forward pools them at each row's last token that is not padding (sequence classification)
    classifier: str | None = None
    pooled: bool = False
    # keyword inputs of a training forward (transformers: use_cache=False, so that no cache is built and a packed
    # row's position_ids keep its samples apart, as they do in a pipeline stage and under ring attention)
    training_inputs: tuple[tuple[str, Any], ...] = ()
    vocabulary: tuple[str, ...] = ()  # parameters with one row per token (input embedding, output head)
    notes: dict[str, str] = field(default_factory=dict)  # layout -> why this model cannot run it
    moe: tuple[ExpertFacts, ...] = ()  # mixture-of-experts blocks, in block order (empty: a dense model)
    router_loss: RouterLoss | None = None
    # modules with weights that text batches never run: a multimodal model's vision or audio encoder and projector
    towers: tuple[str, ...] = ()

    @property
    def expert_parameters(self) -> tuple[str, ...]:
        """Full names of every routed expert's parameters (what expert parallelism places by expert)."""
        return tuple(f"{facts.path}.{name}" for facts in self.moe for name in facts.bank_parameters)

    def aliases(self) -> dict[str, str]:
        """Tied parameter name -> the one name it is stored under (the first of its group)."""
        return {alias: group[0] for group in self.tied for alias in group[1:]}

    def head_counts(self) -> dict[str, int]:
        """Every distinct head count the model's attention splits: {'heads': 4, 'kv_heads': 2}."""
        counts: dict[str, int] = {}
        for facts in self.attention:
            if facts.heads is not None:
                counts.setdefault("heads", facts.heads)
            if facts.kv_heads is not None:
                counts.setdefault("kv_heads", facts.kv_heads)
        return counts


def has_meta_tensors(model: nn.Module) -> bool:
    """Some parameter or buffer is on the meta device (built without storage, materialised after sharding)."""
    return any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers()))


def tied_parameters(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Groups of parameter names that are one tensor (e.g. a head tied to the input embedding)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def takes_argument(forward: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def takes_cache_switch(model: Any) -> bool:
    """Whether `use_cache=False` can be passed to `model` (a transformers model): its forward names it, or its
    config has the switch and the forward hands keywords on (GraniteMoeHybrid's `**kwargs` reach its base model,
    which otherwise builds a cache the training forward cannot use)."""
    if takes_argument(model.forward, "use_cache"):
        return True
    try:
        keywords = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()
        )
    except (TypeError, ValueError):
        return False
    return keywords and isinstance(getattr(getattr(model, "config", None), "use_cache", None), bool)
