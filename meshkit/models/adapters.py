"""Adapter layers injected into a model (peft LoRA), recognised by their shape: no import of peft here.

peft wraps each targeted layer in place: the original weight moves to `<layer>.base_layer.weight` and the
adapter adds `<layer>.lora_A.<adapter>.weight` / `<layer>.lora_B.<adapter>.weight` with a `scaling` per
adapter. What meshkit needs to know about that is said here, once: which parameters a base checkpoint does
not hold (and their initialisation), where a wrapped weight sits in the base checkpoint, and how to fold an
adapter into its base weight for a merged export (W + scaling · B @ A).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_ADAPTER_PARAMETER = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.")
_SAVED_ADAPTER_PART = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.|$)")
_BASE_LAYERS = re.compile(r"(\.base_layer)+\.")  # one wrapper, or several nested (LoRA on two parameters)
_SAVED_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")
_ORIGINAL_COPY = ".original_module."


def is_adapter_parameter(name: str) -> bool:
    """A parameter an adapter added (no base checkpoint holds it)."""
    return _ADAPTER_PARAMETER.search(f".{name}") is not None


def is_saved_module_copy(name: str) -> bool:
    """A parameter of the trained copy of a module peft's `modules_to_save` wraps (the base checkpoint holds
    it under the module's own name; the adapter file holds the trained one)."""
    return _SAVED_COPY.search(f".{name}") is not None


def is_original_module_copy(name: str) -> bool:
    """A parameter of the frozen original a `modules_to_save` wrapper keeps beside its trained copy."""
    return _ORIGINAL_COPY in f".{name}"


def is_adapter_state(name: str) -> bool:
    """What an adapter file holds: the adapter's own parameters and the trained copies of saved modules."""
    return is_adapter_parameter(name) or is_saved_module_copy(name)


def adapter_parameter_name(saved: str, adapter: str = "default") -> str:
    """Where a weight of a peft adapter file (`base_model.model.<layer>.lora_A.weight`) sits in the adapted model,
    relative to the model peft wraps (`<layer>.lora_A.<adapter>.weight`; peft saves a DoRA magnitude without
    `.weight`)."""
    name = saved.removeprefix("base_model.model.")
    if _SAVED_ADAPTER_PART.search(name) is None:  # a saved module's trained copy
        module, _, tensor = name.rpartition(".")
        return f"{module}.modules_to_save.{adapter}.{tensor}"
    name = _SAVED_ADAPTER_PART.sub(rf".\1.{adapter}\2", name)
    return f"{name}.weight" if name.endswith(f"lora_magnitude_vector.{adapter}") else name


def base_checkpoint_name(name: str) -> str:
    """Where a (possibly adapter-wrapped) parameter sits in the base model's checkpoint."""
    return _SAVED_COPY.sub(".", _BASE_LAYERS.sub(".", name).replace(_ORIGINAL_COPY, "."))


def wrapped_module(module: nn.Module) -> nn.Module:
    """The module under peft's adapter wrappers (LoRA on a layer or on a parameter, nested), or `module`."""
    while isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and isinstance(
        getattr(module, "base_layer", None), nn.Module
    ):
        module = cast(nn.Module, module.base_layer)
    return module


def parameter_adapters(module: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """The module under peft's LoRA-on-parameter wrappers (`target_parameters`: one wrapper per adapted
    parameter, nested), and those wrappers by the name of the parameter each adapts."""
    wrappers: dict[str, nn.Module] = {}
    while isinstance(name := getattr(module, "parameter_name", None), str) and wrapped_module(module) is not module:
        wrappers[name] = module
        module = cast(nn.Module, module.base_layer)
    return module, wrappers


def expert_delta(wrapper: Any, experts: int, first: int, count: int, shape: torch.Size) -> torch.Tensor | None:
    """The active adapters' update of experts [first, first + count) of the bank parameter `wrapper` adapts, shaped
    like that parameter's piece (`shape`); None when no adapter is active. peft stacks one rank-r update per
    expert: A [E·r, in] expert-major, B [out, r·E] expert-minor (`ParamWrapper.get_delta_weight`)."""
    if getattr(wrapper, "disable_adapters", False) or getattr(wrapper, "merged", False):
        return None
    delta = None
    for adapter in (name for name in wrapper.active_adapters if name in wrapper.lora_A):
        a = wrapper.lora_A[adapter].weight
        b = wrapper.lora_B[adapter].weight
        low_a = a.reshape(experts, -1, a.shape[-1])[first : first + count]  # [e, r, in]
        low_b = b.reshape(b.shape[0], -1, experts)[:, :, first : first + count]  # [out, r, e]
        swapped = getattr(wrapper, "_did_swap_in_out_features", None)
        if swapped is None:  # (a peft without the flag: the piece's own shape tells [E, out, in] from [E, in, out])
            swapped = tuple(shape[1:]) == (b.shape[0], a.shape[-1])
        update = torch.einsum("ore,eri->eoi" if swapped else "ore,eri->eio", low_b, low_a) * wrapper.scaling[adapter]
        delta = update if delta is None else delta + update
    return delta


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """peft's LoRA layers (typed Any: their adapters, scaling and flags are peft's own attributes)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and hasattr(module, "base_layer"):
            yield name, module


def has_adapters(model: nn.Module) -> bool:
    return next(_lora_layers(model), None) is not None


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The adapted layers run their base weights only (the base model, e.g. DPO's reference), leaving every
    parameter's `requires_grad` as it is: peft's own `disable_adapter` switches the adapters' off and on again,
    which a sharded model (FSDP2) does not follow between two forwards of one step."""
    layers = [module for _, module in _lora_layers(model)]
    before = [module._disable_adapters for module in layers]
    for module in layers:
        module._disable_adapters = True
    try:
        yield
    finally:
        for module, was in zip(layers, before, strict=True):
            module._disable_adapters = was


@dataclass(frozen=True)
class LoraParts:
    """Module names (relative to the LoRA layer) of its wrapped base layer and its adapters' A and B."""

    base: str
    a: tuple[str, ...]
    b: tuple[str, ...]


def lora_parts(module: nn.Module) -> LoraParts | None:
    """How a LoRA layer is made (None for any other module): for a tensor-parallel plan of its pieces."""
    parts: list[Any] = [getattr(module, key, None) for key in ("lora_A", "lora_B")]
    if not all(isinstance(part, nn.ModuleDict) for part in parts) or not hasattr(module, "base_layer"):
        return None
    return LoraParts("base_layer", tuple(f"lora_A.{k}" for k in parts[0]), tuple(f"lora_B.{k}" for k in parts[1]))


def inside_lora_layer(name: str, lora_layers: set[str]) -> bool:
    """A module that is a piece of a LoRA layer (its base layer, an adapter, its dropout)."""
    for marker in (".base_layer", ".lora_"):
        index = name.find(marker)
        if index > 0 and name[:index] in lora_layers:
            return True
    return False


def adapter_submodules(module: nn.Module) -> list[nn.Module]:
    """The modules holding a LoRA layer's adapter weights (empty when `module` is not a LoRA layer)."""
    parts: list[Any] = [getattr(module, key, None) for key in ("lora_A", "lora_B")]
    if not all(isinstance(part, nn.ModuleDict) for part in parts) or not hasattr(module, "base_layer"):
        return []
    return [sub for part in parts for sub in part.values()]


@torch.no_grad()
def reset_adapter(module: nn.Module) -> bool:
    """Give a LoRA layer's adapters their initial values (A: Kaiming-uniform, B: zeros, so the adapted model
    starts equal to the base model). True when `module` is such a layer."""
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if not (isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict) and hasattr(module, "base_layer")):
        return False
    layer: Any = module  # peft's LoRA layer
    for adapter in lora_a:
        layer.reset_lora_parameters(adapter, True)  # peft's own initialisation of that adapter
        magnitudes = getattr(module, "lora_magnitude_vector", None)  # DoRA's (peft keeps it empty otherwise)
        if magnitudes is not None and adapter in magnitudes:
            _reset_magnitude(layer.base_layer.weight, magnitudes[adapter].weight)
    return True


def _reset_magnitude(base: torch.Tensor, magnitude: torch.Tensor) -> None:
    """DoRA's magnitude starts as the row norms of the base weight (B = 0, so the adapted layer equals the base).
    Rows are computed where they are held: a ZeRO-3 shard of the base weight and of the magnitude cover the same
    output rows (both are split along their first dimension, of the same length)."""
    local_base = base.to_local() if isinstance(base, DTensor) else base
    local_magnitude = magnitude.to_local() if isinstance(magnitude, DTensor) else magnitude
    local_magnitude.copy_(local_base.float().norm(p=2, dim=1).to(local_magnitude.dtype))


@dataclass(frozen=True)
class LoraMerge:
    """How one merged weight is made: base + scaling · (B @ A), transposed for fan-in-fan-out layers."""

    base: str  # parameter name of the wrapped base weight
    a: str
    b: str
    scaling: float
    transpose: bool  # GPT-2 style Conv1D weights are stored [in, out]
    magnitude: str | None = None  # DoRA: the magnitude vector rescaling each output row
    experts: int = 0  # LoRA on a 3-D parameter (an expert bank, [E, ., .]): one low-rank update per expert


def lora_merges(model: nn.Module, adapter: str = "default") -> dict[str, LoraMerge]:
    """Merged weight name (as the base model names it) -> how to compute it, for every LoRA-wrapped Linear."""
    merges = {}
    for name, module in _lora_layers(model):
        if adapter not in module.lora_A:
            continue
        prefix = f"{name}." if name else ""
        parameter = getattr(module, "parameter_name", None)
        if isinstance(parameter, str):  # peft's LoRA on a parameter: the parameter sits under the wrappers
            inner, path = module.base_layer, f"{prefix}base_layer"
            while wrapped_module(inner) is not inner:
                inner, path = inner.base_layer, f"{path}.base_layer"
            base = f"{path}.{parameter}"
            merges[base_checkpoint_name(base)] = LoraMerge(
                base=base,
                a=f"{prefix}lora_A.{adapter}.weight",
                b=f"{prefix}lora_B.{adapter}.weight",
                scaling=float(module.scaling[adapter]),
                transpose=False,
                experts=int(getattr(inner, parameter).shape[0]) if getattr(inner, parameter).dim() == 3 else 0,
            )
            continue
        merges[f"{prefix}weight"] = LoraMerge(
            base=f"{prefix}base_layer.weight",
            a=f"{prefix}lora_A.{adapter}.weight",
            b=f"{prefix}lora_B.{adapter}.weight",
            scaling=float(module.scaling[adapter]),
            transpose=bool(getattr(module, "fan_in_fan_out", False)),
            magnitude=f"{prefix}lora_magnitude_vector.{adapter}.weight"
            if adapter in getattr(module, "lora_magnitude_vector", {})
            else None,
        )
    return merges


def merged_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, merge: LoraMerge, magnitude: torch.Tensor | None = None
) -> torch.Tensor:
    """The base weight with the adapter folded in, in the base weight's dtype; with DoRA's `magnitude`, each output
    row of W + scaling · B @ A rescaled to that magnitude."""
    if merge.experts:  # A [E·r, in], B [out, E·r] as peft stacks them: W[e] + scaling · B_e @ A_e
        low_a = a.float().reshape(merge.experts, -1, a.shape[-1])
        low_b = b.float().reshape(b.shape[0], -1, merge.experts)
        delta = torch.einsum("ore,eri->eoi", low_b, low_a) * merge.scaling
        delta = delta if delta.shape == base.shape else delta.transpose(1, 2)  # banks stored [E, in, out]
        return (base.float() + delta).to(base.dtype)
    weight = base.float().T if merge.transpose else base.float()  # [out, in]
    weight = weight + (b.float() @ a.float()) * merge.scaling  # [out, r] @ [r, in] -> [out, in]
    if magnitude is not None:
        weight = weight * (magnitude.float() / weight.norm(p=2, dim=1)).unsqueeze(1)
    return (weight.T if merge.transpose else weight).to(base.dtype)
