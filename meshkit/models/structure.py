"""What a model is made of: the one place every strategy asks.

A strategy needs the same facts about any model: where its repeated blocks are (a ModuleList, a Sequential,
nested or the model itself), which modules only the first and the last pipeline stage hold (embeddings; final
norm and head), which parameters are tied, each attention's head counts, and under which argument name the
model's forward takes token positions. `describe()` answers from, in order: the user's override (config keys
`blocks` and `structure.*`), an adapter for `transformers` models (recognised structurally, imported lazily),
the reference GPT, and a generic rule for any `nn.Module`. Mixture-of-experts blocks (router, expert bank,
shared experts, top-k) are recognised by shape in any of them (`experts.py`).
"""

from __future__ import annotations

from torch import nn

from meshkit.config.schema import StructureConfig
from meshkit.models import hf_adapter
from meshkit.models.blocks import BlockError, BlockList, block_units, find_blocks
from meshkit.models.experts import describe_experts
from meshkit.models.facts import (
    HEAD_ATTRIBUTES,
    KV_HEAD_ATTRIBUTES,
    AttentionFacts,
    ModelStructure,
    StageStyle,
    StructureError,
    takes_argument,
    tied_parameters,
)
from meshkit.models.gpt import GPT


def _generic_attention(path: str, blocks: BlockList) -> tuple[AttentionFacts, ...]:
    """Attention modules of a user's own model: those that hold their head count (not their children's names)."""
    found = []
    for index, block in block_units(blocks):
        for name, module in block.named_modules():
            heads = next(
                (getattr(module, a) for a in HEAD_ATTRIBUTES if isinstance(getattr(module, a, None), int)), None
            )
            if heads is None:
                continue
            kv = next(
                (getattr(module, a) for a in KV_HEAD_ATTRIBUTES if isinstance(getattr(module, a, None), int)), heads
            )
            head_dim = getattr(module, "head_dim", None)
            where = ".".join(part for part in (path, str(index), name) if part)
            found.append(AttentionFacts(where, heads, kv, head_dim if isinstance(head_dim, int) else None))
    return tuple(found)


def _gpt(model: GPT) -> ModelStructure:
    cfg = model.cfg
    attention = tuple(
        AttentionFacts(f"layers.{i}.attention", cfg.n_heads, cfg.kv_heads, cfg.head_dim) for i in range(cfg.n_layers)
    )
    return ModelStructure(
        family="gpt",
        blocks="layers",
        first_stage=GPT.pipeline_first,
        last_stage=GPT.pipeline_last,
        stage_style="skip_none",
        attention=attention,
        position_argument="positions",
        tied=tied_parameters(model),
        causal_lm=True,
        vocabulary=("tok_embeddings.weight", "output.weight"),
    )


def _generic(model: nn.Module, blocks_path: str | None) -> ModelStructure:
    try:
        path, blocks = find_blocks(model, blocks_path)
    except BlockError:
        if blocks_path is not None:
            raise
        return ModelStructure(family="generic", blocks=None, tied=tied_parameters(model))  # e.g. one Linear
    first = tuple(getattr(model, "pipeline_first", ()) or ())
    last = tuple(getattr(model, "pipeline_last", ()) or ())
    if path == "" and isinstance(model, nn.Sequential):
        style: StageStyle | None = "sequential"
    elif hasattr(model, "pipeline_first") and hasattr(model, "pipeline_last"):
        style = "skip_none"
    else:
        style = None
    position = "positions" if takes_argument(model.forward, "positions") else None
    return ModelStructure(
        family="generic",
        blocks=path,
        first_stage=first,
        last_stage=last,
        stage_style=style,
        attention=_generic_attention(path, blocks),
        position_argument=position,
        tied=tied_parameters(model),
        moe=describe_experts(path, block_units(blocks)),
    )


def describe(model: nn.Module, blocks: str | None = None, override: StructureConfig | None = None) -> ModelStructure:
    """The structure of `model`; `blocks` and `override` are the user's answers where inference falls short."""
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise StructureError(f"describe the module inside {type(model).__name__}, not the wrapper")
    if isinstance(model, GPT) and blocks is None:
        found = _gpt(model)
    elif hf_adapter.is_transformers_model(model):
        found = hf_adapter.describe(model, blocks)
    else:
        found = _generic(model, blocks)
    return _overridden(found, model, override) if override is not None else found


def _overridden(found: ModelStructure, model: nn.Module, override: StructureConfig) -> ModelStructure:
    changes: dict[str, object] = {}
    if override.first_stage is not None or override.last_stage is not None:
        first = tuple(override.first_stage or ())
        last = tuple(override.last_stage or ())
        for name in (*first, *last):
            try:
                model.get_submodule(name)
            except AttributeError:
                raise StructureError(
                    f"structure names module '{name}', which {type(model).__name__} does not have: "
                    "give dotted module names (see print(model))"
                ) from None
        style = found.stage_style if found.stage_style == "hf" else "skip_none"
        changes.update(first_stage=first, last_stage=last, stage_style=style)
    if override.position_argument is not None:
        if not takes_argument(model.forward, override.position_argument):
            raise StructureError(
                f"{type(model).__name__}.forward has no argument '{override.position_argument}' "
                "(structure.position_argument): name the argument that takes token positions"
            )
        changes["position_argument"] = override.position_argument
    return found if not changes else ModelStructure(**{**found.__dict__, **changes})
