"""Ring attention inside `transformers` models, through their attention-function registry.

Every attention module of a transformers model calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with its projected, rotary-embedded q, k, v. Registering meshkit's ring attention there under its own name and
selecting that name makes the model's own attention code run it; no mask is built for a registered
implementation: ring attention applies the causal mask itself, with the layer's sliding window (the
`sliding_window` the attention passes), packed samples kept apart by `position_ids` (the decoder layer passes
them on), Gemma-2's soft-capped logits (`softcap`) and gpt-oss's attention sinks (`s_aux`). The cp group
travels on each module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkit.core.errors import MeshkitError
from meshkit.parallel.context.ring_attention import ring_attention

IMPLEMENTATION = "meshkit_ring"
GROUP_ATTRIBUTE = "meshkit_cp_group"
CALLED_ATTRIBUTE = "meshkit_ring_called"


class RingAttentionError(MeshkitError):
    """An attention call ring attention cannot compute; the message says which setting to change."""


def ring_attention_function(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [batch, heads, seq, head_dim], k/v [batch, kv_heads, seq, head_dim];
    returns [batch, seq, heads, head_dim]."""
    if dropout:
        raise RingAttentionError(
            f"ring attention has no attention dropout: set the model config's attention dropout to 0 (got {dropout})"
        )
    if attention_mask is not None:  # (transformers builds none for a registered implementation: the model's own)
        raise RingAttentionError(
            f"context parallel: {type(module).__name__} passes an attention mask of its own (built from its "
            "weights or data, e.g. Doge's dynamic mask), which ring attention does not apply: use cp=1"
        )
    _check_inputs(module, query, key, kwargs)
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:  # grouped-query attention: each key/value head serves `repeats` query heads
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    group: dist.ProcessGroup | None = getattr(module, GROUP_ATTRIBUTE, None)
    if group is None:  # (HRM's second stack of blocks, Inkling's attention over earlier blocks' states)
        raise RingAttentionError(
            f"context parallel: {type(module).__name__} calls transformers' attention functions but is none of the "
            "attention modules of the model's blocks that meshkit splits over the sequence: use cp=1"
        )
    setattr(module, CALLED_ATTRIBUTE, True)
    out = ring_attention(
        query,
        key,
        value,
        group,
        causal=getattr(module, "is_causal", True),  # (Gemma-3 with bidirectional attention: False)
        scale=scaling,
        window=kwargs.get("sliding_window"),
        position_ids=kwargs.get("position_ids"),
        sinks=kwargs.get("s_aux"),
        softcap=kwargs.get("softcap"),
    )
    return out.transpose(1, 2).contiguous(), None


def _check_inputs(module: nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Stop where the attention reads something ring attention does not split or apply: keys beyond the sequence
    (DeepSeek-V4's compressed memory) or a float tensor outside transformers' attention arguments (Inkling's
    relative position bias; the batch's integer tensors, labels and the like, pass through) would otherwise be
    dropped or misaligned silently."""
    if key.shape[2] != query.shape[2]:
        raise RingAttentionError(
            f"context parallel: {type(module).__name__} attends over {key.shape[2]} keys for {query.shape[2]} "
            "queries (entries beyond the sequence, e.g. a compressed memory), which ring attention does not split: "
            "use cp=1"
        )
    foreign = sorted(name for name, value in kwargs.items() if isinstance(value, torch.Tensor)
                     and value.is_floating_point() and name not in _standard_arguments())  # fmt: skip
    if foreign:
        raise RingAttentionError(
            f"context parallel: {type(module).__name__} passes {foreign[0]} to its attention function (a tensor "
            "of its own, e.g. a position bias over all keys), which ring attention does not apply: use cp=1"
        )


def _standard_arguments() -> frozenset[str]:
    """The tensors transformers passes to any attention function (its `TransformersKwargs`: positions, packed
    sequence bounds) and those ring attention applies (`s_aux`)."""
    from transformers.utils.generic import TransformersKwargs

    return frozenset(TransformersKwargs.__annotations__) | {"s_aux"}


def use_ring_attention(model: nn.Module, group: dist.ProcessGroup, attention_paths: list[str]) -> None:
    """Make `model`'s attention modules run ring attention over `group`."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, ring_attention_function)
    for path in attention_paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:  # on another pipeline stage
            continue
        setattr(module, GROUP_ATTRIBUTE, group)
        _FirstCallCheck(module, path)
    hf_model: Any = model  # a transformers model
    hf_model.set_attn_implementation(IMPLEMENTATION)


class _FirstCallCheck:
    """After an attention module's first forward, that it went through ring attention: a model that computes
    attention itself (Falcon and Bloom call SDPA or matmuls directly) would otherwise attend within each rank's
    chunk only, silently. Every cp rank runs the same modules, so all of them stop at the same place."""

    def __init__(self, module: nn.Module, path: str) -> None:
        self.path = path
        self.pre = module.register_forward_pre_hook(self.before)
        self.post = module.register_forward_hook(self.after)

    def before(self, module: nn.Module, args: Any) -> None:
        setattr(module, CALLED_ATTRIBUTE, False)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        self.pre.remove()
        self.post.remove()
        if not getattr(module, CALLED_ATTRIBUTE, False):
            raise RingAttentionError(
                f"context parallel: {self.path} ({type(module).__name__}) computes attention itself, not through "
                "transformers' attention functions where ring attention takes over, so each rank would attend "
                "within its own chunk only: use cp=1"
            )
