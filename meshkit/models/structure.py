"""What a model is made of: the one place every strategy asks.

A strategy needs the same facts about any model: where its repeated blocks are (a ModuleList, a Sequential,
nested or the model itself), which modules only the first and the last pipeline stage hold (embeddings; final
norm and head), which parameters are tied, each attention's head counts, and under which argument name the
model's forward takes token positions. `describe()` answers from, in order: the user's override (config keys
`blocks` and `structure.*`), an adapter for `transformers` models (recognised structurally, imported lazily),
the reference GPT, and a generic rule for any `nn.Module`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from meshkit.config import StructureConfig
from meshkit.errors import MeshkitError
from meshkit.models import hf_adapter
from meshkit.models.blocks import BlockError, block_units, find_blocks
from meshkit.models.gpt import GPT

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
    vocabulary: tuple[str, ...] = ()  # parameters with one row per token (input embedding, output head)
    notes: dict[str, str] = field(default_factory=dict)  # layout -> why this model cannot run it

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


def tied_parameters(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Groups of parameter names that are one tensor (e.g. a head tied to the input embedding)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def takes_argument(forward: object, name: str) -> bool:
    try:
        return name in inspect.signature(forward).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _generic_attention(path: str, blocks: nn.Module) -> tuple[AttentionFacts, ...]:
    """Attention modules of a user's own model: those with head-count attributes or q/k/v projections."""
    found = []
    for index, block in block_units(blocks):
        for name, module in block.named_modules():
            heads = next(
                (getattr(module, a) for a in HEAD_ATTRIBUTES if isinstance(getattr(module, a, None), int)), None
            )
            projections = hf_adapter.ATTENTION_CHILDREN & {child for child, _ in module.named_children()}
            if heads is None and not projections:  # neither head counts nor q/k/v projections: not attention
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
