"""Tensor parallel for LoRA layers (peft): each piece of an adapted Linear takes its part of the layer's split.

Column-split layer (q/k/v, gate/up): the base layer and B split their output features; A stays whole on every
rank and sees the whole input, and B's column split sums its input gradient over tp (as for any column-parallel
layer), so A's gradient is whole already. Row-split layer (o, down): the base layer and A split their input
features (A's output is all-reduced like the base layer's); B stays whole and sees the same reduced input on
every rank, so its gradient is whole already. Under sequence parallel A's output is reduce-scattered onto
sequence shards like the base layer's, so B adds its update to this rank's shard and its gradient parts are
summed over tp. Replicated layers (the head) keep every piece whole.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from meshkit.models.adapters import lora_parts
from meshkit.parallel.tensor.auto import TensorParallelError


class LoraSplit(NamedTuple):
    kinds: dict[str, str]  # module name -> style kind, each LoRA layer replaced by its pieces
    partial: list[str]  # parameters each tp rank holds part of the gradient of (summed after backward)
    whole: set[str]  # parameters left whole whose gradient is complete on every rank (never summed)


def _parameters(model: nn.Module, module_names: list[str]) -> list[str]:
    return [f"{name}.{param}" for name in module_names for param, _ in model.get_submodule(name).named_parameters()]


def split_lora_layers(model: nn.Module, kinds: dict[str, str], sequence_parallel: bool) -> LoraSplit:
    """The plan with every LoRA layer's pieces planned (see the module docstring)."""
    out: dict[str, str] = {}
    partial: list[str] = []
    whole: set[str] = set()
    for name, kind in kinds.items():
        parts = lora_parts(model.get_submodule(name))
        if parts is None:
            out[name] = kind
            continue
        if kind in ("fused_qkv", "fused_gate_up"):
            raise TensorParallelError(
                f"LoRA on the fused layer '{name}' is not split by tensor parallel: leave it out of "
                "lora_target_modules, or use tp=1"
            )
        a_names, b_names = [f"{name}.{a}" for a in parts.a], [f"{name}.{b}" for b in parts.b]
        out[f"{name}.{parts.base}"] = kind
        if kind in ("colwise", "colwise_gathered"):  # (B's output gathered as the base layer's)
            out.update(dict.fromkeys(b_names, kind))
            whole |= set(_parameters(model, a_names))
        elif kind in ("rowwise", "rowwise_of_whole") and sequence_parallel:  # A's output reduce-scattered onto
            out.update(dict.fromkeys(a_names, kind))  # sequence shards, as the base layer's: B sees its shard only
            partial += _parameters(model, b_names)
        elif kind in ("rowwise", "rowwise_of_whole"):
            out.update(dict.fromkeys(a_names, kind))
            whole |= set(_parameters(model, b_names))
        else:
            whole |= set(_parameters(model, a_names + b_names))
    return LoraSplit(out, partial, whole)
