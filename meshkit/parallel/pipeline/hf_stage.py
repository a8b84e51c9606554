"""A pipeline stage of a `transformers` causal LM that runs the model's own forward.

The model's forward computes, before its first layer, what every layer needs: rotary tables, the causal
mask, position ids (and, in some families, scaled or position-added embeddings). A stage keeps that forward
and so recomputes all of it for its own layers:
- the embeddings of a later stage are parameter-free stand-ins that return zeros as wide as the hidden states
  it receives (an input projection after them, OPT's project_in, is an identity stand-in), and the
  hidden states received from the previous stage replace the input of this stage's first layer;
- an earlier stage runs the base model (not the LM head's forward, which may post-process logits) with the
  final norm as an identity stand-in, and hands its last layer's output on;
- the last stage runs the whole causal-LM forward and returns logits; a classification model's last stage (a
  reward model) returns its head's per-token outputs, taken from the head before the model pools them.
Parameter names stay those of the whole model. A stage's input is token ids [batch, seq] on the first stage,
hidden states [batch, seq, hidden] on the others.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn

from meshkit.models.blocks import BlockList, block_list
from meshkit.models.structure import ModelStructure


class StandIn(nn.Module):
    """Takes the place of a module another stage holds. Embeddings become zeros [*ids.shape, width]."""

    is_placeholder = True

    def __init__(self, width: int | None = None, embedding: bool = False) -> None:
        super().__init__()
        self.width = width
        self.embedding = embedding  # an embedding's stand-in makes zeros of any input (OPT's positions: a mask)
        # (a forward may read its embedding's weight.device: Llama 4 does) — empty, and never saved
        self.register_buffer("weight", torch.empty(0), persistent=False)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The first tensor given, positionally or by keyword (ModernBERT calls `embeddings(input_ids=...)`): token
        ids (any integer tensor; any input of an embedding) become zeros [*ids.shape, width]; float states pass on
        as they are (OPT's project_in, Bloom's embedding norm)."""
        value = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if value is None:
            raise TypeError(f"a pipeline stage's stand-in got no tensor (arguments: {', '.join(kwargs) or len(args)})")
        if self.width is None or (value.is_floating_point() and not self.embedding):
            return value
        return torch.zeros(*value.shape, self.width, device=value.device)


class _Received:
    """The hidden states this stage received, handed to its first layer by a forward pre-hook."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden, self.hidden = self.hidden, None
        if hidden is None:
            return None
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}


def plain_attributes(module: nn.Module | None) -> dict[str, Any]:
    """`module`'s own plain attributes and its class's (numbers, strings, flags, None), without private ones."""
    if module is None:
        return {}
    found = {**{k: v for cls in reversed(type(module).__mro__) if issubclass(cls, nn.Module) and cls is not nn.Module
                for k, v in vars(cls).items()}, **vars(module)}  # fmt: skip
    return {name: value for name, value in found.items() if not name.startswith("_") and name != "training"
            and (value is None or isinstance(value, (bool, int, float, str)))}  # fmt: skip


class _BlockOutputs:
    """How the model's blocks return their hidden states — a tensor (most families) or a tuple or list led by it
    (Bloom, Falcon, OpenAI GPT: the model's loop takes `outputs[0]`) — learnt from this stage's own blocks."""

    def __init__(self, unpacked: int = 1) -> None:
        self.as_tuple: bool | None = None
        self.length = unpacked  # how many values the model's loop unpacks from a block (Bamba: 2)
        self.sequence: type = tuple

    def learn(self, module: nn.Module, args: Any, output: Any) -> None:
        self.as_tuple = isinstance(output, (tuple, list))
        self.length = len(output) if isinstance(output, (tuple, list)) else 1
        self.sequence = type(output) if isinstance(output, list) else tuple


class _Skipped(nn.Module):
    """Stands in for another stage's block, returning the hidden states as the model's blocks do. Before this
    stage's first own forward the form is unknown: a block before this stage's own ones then returns them with a
    leading axis, which `outputs[0]` removes and which nothing reads otherwise (the first own block is handed the
    received hidden states)."""

    is_placeholder = True

    def __init__(self, outputs: _BlockOutputs, placeholder: nn.Module | None = None) -> None:
        super().__init__()
        self.outputs = outputs
        for name, value in plain_attributes(placeholder).items():
            if name != "is_placeholder":
                setattr(self, name, value)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.outputs.as_tuple is None and self.outputs.length > 1:
            return (hidden, *[None] * (self.outputs.length - 1))
        if self.outputs.as_tuple is None:
            return hidden.unsqueeze(0)
        if self.outputs.as_tuple:
            return self.outputs.sequence((hidden, *[None] * (self.outputs.length - 1)))
        return hidden


def unpacked_from_blocks(base: nn.Module, blocks_name: str) -> int:
    """How many values the base model's forward unpacks from each block (`a, b = layer(...)` in its loop over
    `self.<blocks_name>`), read from its code; 1 when it unpacks none or the code cannot be read."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return 1
    loop = re.search(rf"for\s+(?:\w+\s*,\s*)?(\w+)\s+in\s+[^\n]*self\.{re.escape(blocks_name)}\b", source)
    if loop is None:
        return 1
    call = re.search(rf"^\s*([\w\s,]+?)\s*=\s*{re.escape(loop.group(1))}\(", source, re.MULTILINE)
    return call.group(1).count(",") + 1 if call and "," in call.group(1) else 1


def _learn_block_outputs(blocks: BlockList, unpacked: int = 1) -> None:
    """Other stages' blocks return what this stage's blocks return."""
    outputs = _BlockOutputs(unpacked)
    for index, block in enumerate(blocks):
        if getattr(block, "is_placeholder", False):
            blocks[index] = _Skipped(outputs, block)
        else:
            block.register_forward_hook(outputs.learn)


def make_transformers_stage(
    chunk: nn.Module, structure: ModelStructure, first: bool, last: bool, first_block: int
) -> nn.Module:
    """Turn `chunk` (the whole model, other stages' layers already skipped) into this stage, in place."""
    blocks = block_list(chunk, structure.blocks)
    # the base model: the blocks' parent (Llama 4's base_model_prefix names no module of its causal LM)
    holder = (structure.blocks or "").rpartition(".")[0]
    base = chunk.get_submodule(holder) if holder else chunk
    _learn_block_outputs(blocks, unpacked_from_blocks(base, (structure.blocks or "").rpartition(".")[2]))
    received = _Received()
    embeddings: list[StandIn] = []  # (their zeros are as wide as the hidden states received)
    if not first:
        for name in structure.first_stage:  # (Phi-4-multimodal's feature embedding takes ids too: no embedding_dim)
            embedding = hasattr(chunk.get_submodule(name), "embedding_dim")
            chunk.set_submodule(name, stand_in := StandIn(0, embedding))
            embeddings.append(stand_in)
        blocks[first_block].register_forward_pre_hook(received.hook, with_kwargs=True)
    if not last:
        for name in structure.last_stage:
            chunk.set_submodule(name, StandIn())
    handed_on: dict[str, torch.Tensor] = {}  # a stage before the last hands on what the next block receives
    own = [index for index, block in enumerate(blocks) if not isinstance(block, _Skipped)]
    if not last and own and own[-1] + 1 < len(blocks):
        blocks[own[-1] + 1].register_forward_pre_hook(
            lambda _m, args, kwargs: handed_on.update(hidden=args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True,
        )  # (after every hook of the block before it: sequence parallel's gather)
    forward = chunk.forward  # the causal-LM forward of this instance's class
    head: dict[str, torch.Tensor] = {}
    if last and structure.classifier is not None:
        chunk.get_submodule(structure.classifier).register_forward_hook(lambda _m, _a, out: head.update(outputs=out))

    def stage_forward(value: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # kwargs: e.g. cp's position_ids
        if first:
            ids = value
        else:  # hidden states [batch, seq, hidden]: the ids only give the forward its shapes
            received.hidden = value
            for stand_in in embeddings:
                stand_in.width = value.shape[-1]
            ids = torch.zeros(value.shape[:2], dtype=torch.long, device=value.device)
        if last and structure.classifier is not None:
            forward(input_ids=ids, use_cache=False, **kwargs)  # (its pooling reads ids this stage lacks: not used)
            return head.pop("outputs")
        if last:
            return forward(input_ids=ids, use_cache=False, **kwargs).logits
        # (what the model does after its blocks is not this stage's: NanoChat's weightless norm, used before the
        # blocks too, runs there)
        output = base(input_ids=ids, use_cache=False, **kwargs)
        return handed_on.pop("hidden", output.last_hidden_state)

    chunk.forward = stage_forward
    return chunk
