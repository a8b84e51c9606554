"""Quantized frozen base layers (bitsandbytes `Linear4bit` / `Linear8bitLt`, as transformers' `BitsAndBytesConfig`
loads them), recognised by their weights: no import of bitsandbytes unless such a layer is there.

A 4-bit weight is a packed `uint8` tensor with a `quant_state` (blockwise absmax, code book, original shape and
dtype); an 8-bit weight is an `int8` tensor with its per-row scales `SCB`. Their state dicts carry that
bookkeeping as extra entries (`weight.absmax`, `weight.quant_map`, `weight.quant_state.*`, `SCB`,
`weight_format`). What meshkit needs to know about that is said here, once: which layers are quantized, and the
model's weights in full precision with the bookkeeping left out, for a merged export that `from_pretrained`
loads as an ordinary model.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

QuantKind = Literal["4bit", "8bit"]
_BOOKKEEPING = (
    ".weight.absmax",
    ".weight.quant_map",
    ".weight.nested_",
    ".weight.quant_state.",
    ".SCB",
    ".weight_format",
)


def quantized_kind(module: nn.Module) -> QuantKind | None:
    """'4bit' or '8bit' for a quantized linear layer, None for any other module."""
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    if weight is None:
        return None
    if getattr(weight, "quant_state", None) is not None or (
        weight.dtype == torch.uint8 and getattr(module, "quant_state", None) is not None
    ):
        return "4bit"
    if weight.dtype == torch.int8 and _row_scales(module) is not None:
        return "8bit"
    return None


def _row_scales(module: nn.Module) -> torch.Tensor | None:
    """An int8 layer's per-row scales: on its weight until the first forward moves them to the layer's state."""
    scales = getattr(module.weight, "SCB", None)
    return scales if scales is not None else getattr(getattr(module, "state", None), "SCB", None)


def quantized_layers(model: nn.Module) -> dict[str, QuantKind]:
    """Module name -> kind, for every quantized linear layer of `model`."""
    found = {}
    for name, module in model.named_modules():
        kind = quantized_kind(module)
        if kind is not None:
            found[name] = kind
    return found


def parameter_count(model: nn.Module) -> int:
    """Parameters of `model` as its unquantized form has them (a packed 4-bit weight counts its full shape)."""
    total = 0
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            state = getattr(param, "quant_state", None) if name == "weight" else None
            total += state.shape.numel() if state is not None else param.numel()
    return total


def is_quantized(model: nn.Module) -> bool:
    return any(quantized_kind(module) is not None for module in model.modules())


@torch.no_grad()
def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The full-precision weight of a quantized linear layer ([out, in], in the dtype it was quantized from)."""
    import bitsandbytes.functional as bnb_functional

    kind = quantized_kind(module)
    weight = module.weight
    if kind == "4bit":
        state = getattr(weight, "quant_state", None) or module.quant_state
        module.state_dict()  # undoes bitsandbytes' CPU inference repacking (done in place by an eval forward)
        state = getattr(module.weight, "quant_state", None) or state
        full = bnb_functional.dequantize_4bit(module.weight.data, state)
        return full.to(state.dtype).reshape(state.shape)
    if kind == "8bit":
        dtype = module.bias.dtype if getattr(module, "bias", None) is not None else torch.float32
        return bnb_functional.int8_vectorwise_dequant(weight.data, _row_scales(module)).to(dtype)
    raise TypeError(f"{type(module).__name__} is not a quantized linear layer")


def is_bookkeeping(name: str) -> bool:
    """A state-dict entry that only describes a quantized weight (absmax, code book, scales, format)."""
    return any(marker in f".{name}" for marker in _BOOKKEEPING)


def full_precision_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's state dict) with each quantized weight dequantized and its bookkeeping left out."""
    layers = quantized_layers(model)
    if not layers:
        return state
    out = {name: tensor for name, tensor in state.items() if not is_bookkeeping(name)}
    modules = dict(model.named_modules())
    for name in layers:
        key = f"{name}.weight" if name else "weight"
        if key in out:
            out[key] = dequantized_weight(modules[name])
    return out
