"""Which of a model's modules compute each token on its own: the blocks' MLPs, whose intermediate activations
(several times the hidden size) can then be computed a slice of the sequence at a time (`tiled_mlp`).

A block's child named as MLPs are (`mlp`, `feed_forward`, `ffn`, a class named `...MLP`) is a candidate; a
mixture-of-experts block is not (its router keeps state of the whole batch). Where the weights are real, one call
on sample hidden states checks it: its output on the whole sequence equals its outputs on two halves put together
(an MLP that mixes positions, or returns more than one tensor, is left whole).
"""

from __future__ import annotations

import torch
from torch import nn

from meshkit.models.blocks import block_list, block_name, block_units
from meshkit.models.facts import ModelStructure

MLP_NAMES = ("mlp", "feed_forward", "ffn")
SAMPLE_TOKENS = 4


def token_wise_mlps(model: nn.Module, structure: ModelStructure) -> tuple[str, ...]:
    """Dotted names of the blocks' MLPs that compute each token on its own."""
    if structure.blocks is None:
        return ()
    experts = {facts.path for facts in structure.moe}
    found = []
    for index, block in block_units(block_list(model, structure.blocks)):
        for child_name, child in block.named_children():
            name = f"{block_name(structure.blocks, index)}.{child_name}"
            if name in experts or not _named_as_mlp(child_name, child):
                continue
            if _token_wise(child):
                found.append(name)
    return tuple(found)


def _named_as_mlp(name: str, module: nn.Module) -> bool:
    kind = type(module).__name__
    return name in MLP_NAMES or kind.endswith("MLP") or kind.endswith("FeedForward")


def _token_wise(module: nn.Module) -> bool:
    """The module on sample tokens equals its halves' outputs put together (trusted where weights are on meta)."""
    weight = next((p for p in module.parameters()), None)
    if weight is None:
        return False
    if weight.is_meta:
        return True
    width = _input_width(module)
    if width is None:
        return False
    generator = torch.Generator().manual_seed(0)
    # a quantized base layer's weight is packed integers: the sample takes the floating-point parameters' dtype
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    sample = torch.randn(1, SAMPLE_TOKENS, width, generator=generator).to(weight.device, dtype)
    try:
        with torch.no_grad():
            whole = module(sample)
            halves = [module(part) for part in sample.chunk(2, dim=1)]
    except Exception:  # noqa: BLE001 - an MLP that does not take one hidden-state tensor is left whole
        return False
    if not isinstance(whole, torch.Tensor) or not all(isinstance(half, torch.Tensor) for half in halves):
        return False
    joined = torch.cat(halves, dim=1)
    return whole.shape == joined.shape and torch.allclose(whole, joined, rtol=1e-4, atol=1e-5)


def _input_width(module: nn.Module) -> int | None:
    """The hidden size the module takes: its first linear layer's input features."""
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    return first.in_features if first is not None else None
