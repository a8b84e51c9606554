"""The structure of `transformers` models, recognised by their classes' shape (no import of transformers here).

Decoder-only causal LMs share one layout: `model.<base prefix>` holds the embeddings, a ModuleList of decoder
layers and a final norm; the head is the model's output embedding; head counts live in `model.config` (and on
the attention module in some families). Whatever a family does differently is said here, once.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import sys
from typing import Any, cast

import torch
from torch import nn

from meshkit.models.blocks import BlockError, BlockList, block_units, find_blocks
from meshkit.models.experts import describe_experts, router_loss
from meshkit.models.facts import (
    CAUSAL_LM_CLASSES,
    ModelStructure,
    StructureError,
    takes_argument,
    takes_cache_switch,
    tied_parameters,
)
from meshkit.models.hf_attention_facts import (
    attention_modules,
    layouts_refused,
    mask_readers,
    unattended_blocks,
)


def is_transformers_model(model: nn.Module) -> bool:
    """True for a `transformers` PreTrainedModel (checked by class ancestry, so transformers stays optional)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(model).__mro__
    )


@functools.cache
def _causal_lm_class(names: tuple[str, ...]) -> bool:
    """A causal-LM head class or a subclass of one (`names`: its classes, itself first): by a name's ending, or
    listed as one by transformers' own registry (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: BertGenerationDecoder)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        registered = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    except ImportError:  # (transformers is optional)
        registered = set()
    return any(name.endswith(CAUSAL_LM_CLASSES) or name in registered for name in names)


def module_initializer(model: nn.Module) -> Any:
    """A transformers model's own per-module initialisation (`_init_weights`, which also recomputes rotary
    tables), as `init(name, module)`; None for any other model."""
    if not is_transformers_model(model) or not hasattr(model, "_init_weights"):
        return None

    hf_model: Any = model  # a transformers model: its methods are transformers' own

    def init(_name: str, module: nn.Module) -> None:
        hf_model._init_weights(module)

    return init


def config_files(model: nn.Module) -> dict[str, str]:
    """`config.json` (and `generation_config.json`) of a transformers model, as text; {} for other models."""
    if not is_transformers_model(model):
        return {}
    hf_model: Any = model  # a transformers model: its config is transformers' own
    config = hf_model.config.to_diff_dict()
    config.pop("quantization_config", None)  # exports hold full-precision weights (a quantized base is dequantized)
    files = {"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        files["generation_config.json"] = generation.to_json_string()
    return files


@functools.cache
def _forward_source(cls: type[nn.Module]) -> str | None:
    """The code of `cls.forward` (read once per class); None when it cannot be read."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return None


def text_config(config: Any) -> Any:
    """The config of the text decoder (a multimodal config's text_config; the config itself otherwise)."""
    try:
        return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    except (TypeError, ValueError):
        return config


def _forward_order(base: nn.Module, config: Any, blocks: str) -> dict[str, int]:
    """Where each child of the model's base runs in its forward: the order its declared pipeline plan
    (`base_model_pp_plan`) gives, else where its forward's code first uses it (`self.<child>`: also for a child
    the plan leaves out, Phi-4-multimodal's feature embedding, placed against the blocks); {} when neither is known
    (then the order the children are registered in stands)."""
    plan = getattr(text_config(config), "base_model_pp_plan", None)
    if plan:
        planned = {name: 2 * index for index, name in enumerate(plan)}
        code = _code_order(base)
        if blocks in planned and blocks in code:  # (before the blocks or after them, beside them in the plan)
            planned.update({name: planned[blocks] + (1 if at > code[blocks] else -1)
                            for name, at in code.items() if name not in planned})  # fmt: skip
        return planned
    return _code_order(base)


def _code_order(base: nn.Module) -> dict[str, int]:
    source = _forward_source(cast(Any, type(base)))
    if source is None:
        return {}
    found = {name: re.search(rf"self\.{re.escape(name)}\b", source) for name, _ in base.named_children()}
    return {name: match.start() for name, match in found.items() if match is not None}


def _classifier(model: Any, base: nn.Module) -> str | None:
    """A sequence- or token-classification model's head: its one child beside the base model that has weights
    (`score`, GPT-2's `classifier`; a dropout beside it has none)."""
    if not type(model).__name__.endswith(("ForSequenceClassification", "ForTokenClassification")) or base is model:
        return None
    heads = [name for name, child in model.named_children()
             if child is not base and next(child.parameters(), None) is not None]  # fmt: skip
    return heads[0] if len(heads) == 1 else None


def _text_blocks(model: Any, names: dict[int, str], blocks_override: str | None) -> tuple[str, BlockList]:
    """The decoder layers: searched inside the model's decoder (`get_decoder()`) first, so that a multimodal
    model's vision encoder layers are never taken for them."""
    if blocks_override is None:
        try:
            decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
        except (AttributeError, NotImplementedError, ValueError):
            decoder = None
        if isinstance(decoder, nn.Module) and decoder is not model and id(decoder) in names:
            try:
                path, blocks = _declared_blocks(model, decoder) or find_blocks(decoder)
            except BlockError:
                pass
            else:
                return ".".join(part for part in (names[id(decoder)], path) if part), blocks
    return find_blocks(model, blocks_override)


def _declared_blocks(model: Any, decoder: nn.Module) -> tuple[str, BlockList] | None:
    """The block list the model's declared pipeline plan names (the entry taking and returning hidden states:
    `"layers": (["hidden_states", ...], ["hidden_states"])`), when it is a list of blocks in `decoder` — before any
    count of repeats (Gemma-3n's three AltUp projections outnumber a two-layer model's layers)."""
    config = model.config.get_text_config() if callable(getattr(model.config, "get_text_config", None)) else None
    plan = getattr(config or model.config, "base_model_pp_plan", None)
    for name, entry in (plan or {}).items():
        takes = entry[0] if isinstance(entry, (tuple, list)) and entry else ()
        if "hidden_states" not in takes:
            continue
        try:
            found = decoder.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 0:
            return name, found
    return None


def _composite(config: Any) -> bool:
    """A multimodal config: its text model has a config of its own (Gemma 3's text_config beside vision_config)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return text is not config


def _towers(model: nn.Module, names: dict[int, str], base_name: str, heads: tuple[str, ...]) -> tuple[str, ...]:
    """Modules with weights beside the path from the model to its text model, other than the `heads` (a multimodal
    model's vision or audio encoder and projector): text batches never run them."""
    out, parent, parts = [], model, base_name.split(".") if base_name else []
    for depth in range(len(parts)):
        on_path = parent.get_submodule(parts[depth])
        for child in parent.children():
            name = names[id(child)]
            if child is not on_path and name not in heads and next(child.parameters(), None) is not None:
                out.append(name)
        parent = on_path
    return tuple(out)


def describe(model: Any, blocks_override: str | None) -> ModelStructure:

    version = int(str(getattr(sys.modules.get("transformers"), "__version__", "5")).split(".")[0])
    if version < 5:
        raise StructureError(
            f"meshkit reads transformers 5 models; this is transformers {version}: pip install 'meshkit[hf]'"
        )
    config = model.config
    family = str(getattr(config, "model_type", type(model).__name__))
    names = {id(module): name for name, module in model.named_modules()}
    path, blocks = _text_blocks(model, names, blocks_override)
    # the module that holds the blocks beside the embeddings and final norm (the model's base_model; Llama 4's
    # text model is not under the name its base_model_prefix gives)
    base_name = path.rpartition(".")[0]
    base = model.get_submodule(base_name) if base_name else model
    first, last, after_blocks = [], [], False
    order = _forward_order(base, config, path.rpartition(".")[2])
    blocks_at = order.get(path.rpartition(".")[2])
    for local, child in base.named_children():
        name = names[id(child)]
        at = order.get(local)
        known_after = at is not None and blocks_at is not None and at > blocks_at
        if child is blocks:
            after_blocks = True
        elif next(child.parameters(), None) is None and not known_after:
            continue  # (rotary tables; a norm without weights after the blocks runs there: OLMo's)
        elif known_after if at is not None and blocks_at is not None else after_blocks:
            last.append(name)  # run after the blocks (OPT registers its final_layer_norm before its layers)
        else:
            first.append(name)  # before the blocks: embeddings, Bloom's embedding norm
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and head is not base and id(head) in names:
        last.append(names[id(head)])
    causal = _causal_lm_class(tuple(base.__name__ for base in type(model).__mro__)) and not getattr(
        config, "is_encoder_decoder", False
    )
    classifier = _classifier(model, base)
    if classifier is not None:
        last.append(classifier)
    moe = describe_experts(path, block_units(blocks), config)
    attention = attention_modules(config, path, blocks, frozenset(facts.path for facts in moe))
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocabulary = tuple(
        f"{names[id(m)]}.{part}"
        for m in (embedding, head)
        if m is not None and id(m) in names
        for part in ("weight", "bias")
        if isinstance(getattr(m, part, None), torch.Tensor)
    )  # (a head's bias has a row per token too: Phi's)
    return ModelStructure(
        family=family,
        blocks=path,
        first_stage=tuple(first),
        last_stage=tuple(last),
        stage_style="hf" if (causal or classifier) and base_name and first else None,
        attention=attention,
        position_argument="position_ids" if takes_argument(model.forward, "position_ids") else None,
        tied=tied_parameters(model),
        causal_lm=causal,
        classifier=classifier,
        pooled=classifier is not None and type(model).__name__.endswith("ForSequenceClassification"),
        training_inputs=(("use_cache", False),) if takes_cache_switch(model) else (),
        notes=layouts_refused(
            config, family, unattended_blocks(path, blocks, attention), mask_readers(model, attention)
        ),
        vocabulary=tuple(dict.fromkeys(vocabulary)),
        moe=moe,
        router_loss=router_loss(config, moe),
        towers=_towers(model, names, base_name, tuple(last)) if _composite(config) else (),
    )
