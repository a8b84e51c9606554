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

from dataclasses import dataclass
from typing import Any, Literal, cast

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
    if _quant_state(module) is not None:
        return "4bit"
    if weight.dtype == torch.int8 and _row_scales(module) is not None:
        return "8bit"
    return None


def _quant_state(module: nn.Module) -> Any:
    """A 4-bit layer's quantization state: on its weight, or on the layer once FSDP re-wrapped the packed weight
    (bitsandbytes keeps a copy there); None for any other layer."""
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    if weight is None:
        return None
    state = getattr(weight, "quant_state", None)
    return state if state is not None else getattr(module, "quant_state", None)


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
        state = _quant_state(module)
        for name, param in module.named_parameters(recurse=False):
            total += state.shape.numel() if state is not None and name == "weight" else param.numel()
    return total


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized layer's weight as its unquantized model has it: shape, dtype, and how to get it back."""

    module: nn.Module
    kind: QuantKind
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def stored_transposed(self) -> bool:
        """The unquantized model holds this weight transposed ([in, out]: GPT-2's Conv1D, which transformers
        quantizes as a Linear); its checkpoint does too."""
        source = getattr(self.module, "source_cls", None)
        return isinstance(source, type) and source.__name__ == "Conv1D"

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.stored_transposed else self.shape

    def as_checkpoint(self, weight: torch.Tensor) -> torch.Tensor:
        """A dequantized (and merged) weight in the layout the model's checkpoint holds it."""
        return weight.t().contiguous() if self.stored_transposed else weight

    @torch.no_grad()
    def dequantize(self, stored: torch.Tensor) -> torch.Tensor:
        """The full-precision weight from the whole stored one (under ZeRO-3: once gathered)."""
        import bitsandbytes.functional as bnb_functional

        if self.kind == "4bit":
            state = _quant_state(self.module)
            return bnb_functional.dequantize_4bit(stored, state).to(self.dtype).reshape(self.shape)
        scales = _row_scales(self.module)
        if scales is None:
            raise ValueError(f"an int8 layer ({type(self.module).__name__}) without its row scales (SCB)")
        return bnb_functional.int8_vectorwise_dequant(stored, scales).to(self.dtype)


def quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """State-dict name of each quantized weight -> what it dequantizes to."""
    out = {}
    for name, kind in quantized_layers(model).items():
        module = model.get_submodule(name)
        if kind == "4bit":
            state = _quant_state(module)
            shape, dtype = tuple(state.shape), state.dtype
        else:
            bias, weight = getattr(module, "bias", None), cast(torch.Tensor, module.weight)
            shape, dtype = tuple(weight.shape), bias.dtype if bias is not None else torch.float32
        out[f"{name}.weight" if name else "weight"] = QuantizedWeight(module, kind, shape, dtype)
    return out


def keep_training_layout(model: nn.Module) -> None:
    """bitsandbytes repacks a 4-bit weight in place for CPU inference (AVX512-BF16 hosts) on an eval forward;
    a trained model (its weight sharded by ZeRO-3 or checkpointed) keeps the one layout it was loaded in. Every
    4-bit layer is asked, quantized yet or not (bitsandbytes may quantize on the first move or forward); the repack
    also fails outright on layers narrower than its block size."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 - (bitsandbytes' flag, not a tensor)


def is_bookkeeping(name: str) -> bool:
    """A state-dict entry that only describes a quantized weight (absmax, code book, scales, format)."""
    return any(marker in f".{name}" for marker in _BOOKKEEPING)


def is_packed_quant_state(name: str) -> bool:
    """A 4-bit weight's serialised quantization state (dtype, shape, nested offset, as bytes): its length varies
    with the values, so a checkpoint's may differ in size from the live model's (after a weight was requantized)."""
    return ".weight.quant_state." in f".{name}"


@torch.no_grad()
def restore_quant_states(model: nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    """Each 4-bit layer takes the quantization state `loaded` (state-dict name -> tensor, as a checkpoint holds it)
    has for it: a weight quantized again during training (ReLoRA's merges) has other scales and offsets than it
    loaded with."""
    from bitsandbytes.functional import QuantState

    for name, kind in quantized_layers(model).items():
        prefix = f"{name}.weight." if name else "weight."
        entries = {key[len(prefix) :]: value for key, value in loaded.items() if key.startswith(prefix)}
        if kind != "4bit" or not any(key.startswith("quant_state.") for key in entries):
            continue
        module: Any = model.get_submodule(name)
        weight: Any = module._parameters["weight"]
        state = QuantState.from_dict(entries, device=weight.device)
        for owner in (weight, module):  # (on the weight, and on the layer once FSDP re-wrapped the weight)
            if getattr(owner, "quant_state", None) is not None:
                owner.quant_state = state


def full_precision_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the unsharded model's state dict) with each quantized weight dequantized and its bookkeeping left
    out (all at once: for a model in one process; the export dequantizes one weight at a time)."""
    weights = quantized_weights(model)
    out = {name: tensor for name, tensor in state.items() if not is_bookkeeping(name)}
    for name, weight in weights.items():
        if name in out:
            out[name] = weight.as_checkpoint(weight.dequantize(out[name]))
    return out
