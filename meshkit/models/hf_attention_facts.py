"""Where a `transformers` model computes attention, and what that means for the layouts: the attention modules
found by their code (not their names), their head counts, latent projections, whole-projection norms and per-head
parameters; the blocks that mix tokens otherwise; what ring attention cannot split."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, cast

import torch
from torch import nn

from meshkit.models.blocks import BlockList, block_units
from meshkit.models.facts import AttentionFacts

# what an attention's code calls: transformers' attention functions, SDPA, flash-attn, or a softmax over scores
ATTENTION_CODE = re.compile(
    r"ALL_ATTENTION_FUNCTIONS|attention_interface|scaled_dot_product_attention|flash_attn|softmax\("
)
MASK_READING_CODE = re.compile(r"attention_mask\s*\[")  # (an attention that reads the mask's values itself)
# the fallback where a module's code cannot be read: the children an attention usually has
ATTENTION_CHILDREN = {
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "c_attn",
    "Wqkv",
    "query_key_value",
    "kv_a_proj_with_mqa",
}


def config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _projection_norms(attention: nn.Module, heads: int | None, kv_heads: int | None, head_dim: int | None) -> tuple:
    """Children of `attention` that normalise a whole projection output (a 1-D weight as wide as all query or
    all key/value heads, wider than one head): OLMo-2's q_norm and k_norm."""
    if heads is None or kv_heads is None or head_dim is None:
        return ()
    widths = {heads * head_dim, kv_heads * head_dim} - {head_dim}
    return tuple(
        name
        for name, child in attention.named_children()
        if not isinstance(child, nn.Linear)
        and isinstance(weight := getattr(child, "weight", None), torch.Tensor)
        and weight.dim() == 1
        and weight.numel() in widths
    )


def _head_parameters(attention: nn.Module, heads: int | None, kv_heads: int | None) -> tuple[str, ...]:
    """The attention's own parameters (outside its layers) with one row per query or key/value head."""
    counts = {count for count in (heads, kv_heads) if count is not None and count > 1}
    return tuple(
        name
        for name, param in attention.named_parameters(recurse=False)
        if param.dim() >= 1 and param.shape[0] in counts
    )


def computes_attention(module: nn.Module) -> bool:
    """An attention module: it holds at least two linear layers of its own (q/k/v or a fused one, and the output)
    and its class's code computes softmax attention (transformers' attention functions, SDPA, a softmax). A
    module whose code cannot be read is judged by its children's names (`ATTENTION_CHILDREN`), a fallback."""
    linears = [child for child in module.children() if isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D"]
    named_like = bool(ATTENTION_CHILDREN & {child for child, _ in module.named_children()})  # (a family's own Linear)
    if len(linears) < 2 and not named_like:
        return False
    found = _code_computes_attention(cast(Any, type(module)))
    return named_like if found is None else found


@functools.cache
def _code_computes_attention(cls: type) -> bool | None:
    """Whether `cls`'s code computes softmax attention; None when it cannot be read (read once per class)."""
    try:
        return bool(ATTENTION_CODE.search(inspect.getsource(cls)))
    except (OSError, TypeError):
        return None


def attention_modules(
    config: Any, blocks_path: str, blocks: BlockList, moe: frozenset[str] = frozenset()
) -> tuple[AttentionFacts, ...]:

    heads = config_int(config, "num_attention_heads", "n_head")
    kv_heads = config_int(config, "num_key_value_heads") or heads
    if getattr(config, "multi_query", False) is True and not getattr(config, "new_decoder_architecture", False):
        kv_heads = 1  # (one key/value head for all: GPT-BigCode, Falcon's first architecture)
    hidden = config_int(config, "hidden_size", "n_embd")
    head_dim = config_int(config, "head_dim") or (hidden // heads if hidden and heads else None)
    latent_width = (config_int(config, "kv_lora_rank") or 0) + (rotary := config_int(config, "qk_rope_head_dim") or 0)
    found: list[AttentionFacts] = []
    for index, block in block_units(blocks):
        for name, module in block.named_modules():
            path = ".".join(part for part in (blocks_path, str(index), name) if part)
            inside = any(path.startswith(f"{facts.path}.") for facts in found)  # (an attention's own parts)
            if path in moe or inside or not computes_attention(module):
                continue
            own_heads = config_int(module, "num_heads", "num_attention_heads") or heads
            own_kv = config_int(module, "num_key_value_heads") or kv_heads
            own_dim = config_int(module, "head_dim") or head_dim
            latent = next(  # (a projection to kv_lora_rank + qk_rope_head_dim features)
                (child for child, sub in module.named_children()
                 if rotary and getattr(sub, "out_features", None) == latent_width),
                None,
            )  # fmt: skip
            norms = _projection_norms(module, own_heads, own_kv, own_dim)
            per_head = _head_parameters(module, own_heads, own_kv)
            found.append(AttentionFacts(path, own_heads, own_kv, own_dim, latent, rotary if latent else 0, norms,
                                        per_head))  # fmt: skip
    return tuple(found)


def layouts_refused(
    config: Any, family: str, unattended: list[tuple[int, str]], mask_readers: list[str]
) -> dict[str, str]:
    """Layouts this family cannot run, with the reason meshkit prints. `unattended`: the blocks (index, path)
    that hold no attention module; `mask_readers`: attention modules whose code reads the attention mask."""
    notes: dict[str, str] = {}
    if mask_readers:  # (ring attention builds no mask: DeepSeek-V3.2's sparse-attention indexer picks from it)
        notes["cp"] = (
            f"{family}'s attention reads the attention mask itself ({mask_readers[0]}, e.g. a sparse-attention "
            "indexer), and ring attention builds none: use cp=1"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    longest = config_int(config, "max_position_embeddings", "n_positions")
    if chunk and (longest is None or chunk < longest):
        notes["cp"] = (
            f"{family} attends within chunks of {config.attention_chunk_size} tokens (attention_chunk_size), which "
            "ring attention does not compute"
        )
    if unattended:  # a linear-attention, state-space or convolution layer sees only its rank's chunk (first)
        index, path = unattended[0]
        kinds = getattr(config, "layer_types", None)
        kind = f" ({kinds[index]})" if isinstance(kinds, (list, tuple)) and index < len(kinds) else ""
        notes["cp"] = (
            f"{family} mixes tokens without attention in {len(unattended)} of its blocks, e.g. {path}{kind}, and ring "
            "attention splits only attention over the sequence: use cp=1"
        )
    return notes


def mask_readers(model: nn.Module, attention: tuple[AttentionFacts, ...]) -> list[str]:
    """The attention modules whose class's code reads the attention mask's values (read once per class)."""
    return [facts.path for facts in attention if _code_reads_mask(cast(Any, type(model.get_submodule(facts.path))))]


@functools.cache
def _code_reads_mask(cls: type) -> bool:
    try:
        return bool(MASK_READING_CODE.search(inspect.getsource(cls)))
    except (OSError, TypeError):
        return False


def unattended_blocks(
    blocks_path: str, blocks: BlockList, attention: tuple[AttentionFacts, ...]
) -> list[tuple[int, str]]:
    """The blocks (index, path) that hold none of the attention modules found."""
    out = []
    for index, _ in block_units(blocks):
        path = ".".join(part for part in (blocks_path, str(index)) if part)
        if not any(facts.path == path or facts.path.startswith(path + ".") for facts in attention):
            out.append((index, path))
    return out
