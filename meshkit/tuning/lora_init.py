"""peft's LoRA initialisations besides the default (`peft_init_lora_weights`, Axolotl's name for peft's
`init_lora_weights`; LoftQ also through `peft: {loftq_config: {loftq_bits: 4}}`).

- `gaussian`, `orthogonal`, `false` change how the adapters start;
- `pissa` (`pissa_niter_<n>`: randomised SVD), `olora` and `loftq` also change the base: each adapted weight W is
  split into its principal low-rank part, which the adapters start as, and the rest, which the frozen base keeps
  (LoftQ: the base becomes W's 4-bit quantization and the adapters start as the low-rank part of the error).

The base is built on the meta device and streams into each rank's shards, so peft cannot decompose it when it wraps
the model. Instead, once the engine has prepared the model, peft runs each initialisation itself on one whole layer
at a time — that layer's weight read from the base checkpoint, wrapped alone with the run's LoRA settings — and the
results are copied into this rank's shards (`Engine.load_full_state_dict`). Every rank computes the same values:
randomness (gaussian, orthogonal, randomised SVD) is seeded by the run seed and the layer's name.

Exports: `merged/` is always the whole trained model. PiSSA and OLoRA adapters are written as peft writes them with
`path_initial_model_for_weight_conversion`: trained and initial adapters side by side (rank 2r), so the adapter
applies to the original base model (`converted_adapter`).
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from safetensors import safe_open
from torch import nn

from meshkit.config.section import Section
from meshkit.core.errors import MeshkitError
from meshkit.models.adapters import base_checkpoint_name
from meshkit.parallel.materialize import safetensors_files


class LoftQBits(Section):
    loftq_bits: int = Field(4, description="bits of LoftQ's quantization of the base (peft's LoftQConfig)")


class PeftBlock(Section):
    """Axolotl's `peft:` block."""

    loftq_config: LoftQBits | None = Field(
        None, description="LoftQ: the base quantized, the adapters start from the error"
    )


RANDOM_INITS = ("gaussian", "orthogonal")  # the adapters only
DECOMPOSITIONS = ("pissa", "olora", "loftq")  # the adapters and the base
NEEDS_DATA = {"eva": "EVA", "corda": "CorDA", "lora_ga": "LoRA-GA"}  # computed from activations or gradients


class LoraInitError(MeshkitError):
    """An initialisation meshkit cannot run; the message names what to use instead."""


def lora_init_mode(value: bool | str | None, loftq_bits: int | None) -> str | None:
    """The initialisation asked for, by peft's name; None for peft's default (A random, B zero)."""
    if loftq_bits is not None and value not in (None, True, "loftq"):
        raise LoraInitError(f"peft.loftq_config asks for LoftQ and peft_init_lora_weights for {value!r}: keep one")
    if loftq_bits is not None:
        return "loftq"
    if value is None or value is True:
        return None
    if value is False:
        return "false"
    mode = str(value).lower()
    if mode in NEEDS_DATA:
        raise LoraInitError(
            f"peft_init_lora_weights: {value} ({NEEDS_DATA[mode]}) derives the adapters from activations or gradients "
            "of a calibration pass, which meshkit does not run: use pissa, olora or the default (remove the key)"
        )
    if mode in (*RANDOM_INITS, *DECOMPOSITIONS) or (mode.startswith("pissa_niter_") and mode[12:].isdigit()):
        return mode
    raise LoraInitError(
        f"peft_init_lora_weights: {value!r} is not an initialisation meshkit runs: true, false, gaussian, orthogonal, "
        "pissa, pissa_niter_<n>, olora or loftq"
    )


def changes_base(mode: str | None) -> bool:
    """The initialisation rewrites the frozen base weights (PiSSA, OLoRA, LoftQ)."""
    return mode is not None and mode.split("_niter_")[0] in DECOMPOSITIONS


@dataclass
class InitialAdapters:
    """What `initialise` gave each LoRA layer: its initial adapter weights (whole), for the export's conversion."""

    mode: str
    weights: dict[str, torch.Tensor] = field(default_factory=dict)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """peft's LoRA layers on modules (not on parameters), by name."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and hasattr(module, "base_layer"):
            yield name, module


@dataclass(frozen=True)
class PlannedLayer:
    """A LoRA layer to start: its name, its base layer's copy on the meta device, the rank and alpha peft gave it."""

    name: str
    template: nn.Module
    rank: int
    alpha: float


def plan(model: nn.Module, peft_config: Any) -> list[PlannedLayer]:
    """Before the engine prepares `model`: each LoRA layer's base layer, copied on the meta device (its type and
    shape), to rebuild whole later. LoRA on parameters (expert banks) takes only the default."""
    if getattr(peft_config, "target_parameters", None):
        raise LoraInitError(
            "peft_init_lora_weights other than the default does not reach LoRA on parameters (lora_target_parameters):"
            " remove one of them"
        )
    return [
        PlannedLayer(name, _template(module), module.r["default"], module.lora_alpha["default"])
        for name, module in lora_layers(model)
    ]


def _template(lora_layer: Any) -> nn.Module:
    """The layer to rebuild whole: a copy of the base layer; a plain Linear of its size where the base is
    quantized (the initialisations that read the base refuse a quantized one; the rest read only its shape)."""
    base = lora_layer.get_base_layer()
    weight = getattr(base, "weight", None)
    if (
        isinstance(weight, torch.Tensor)
        and weight.dtype.is_floating_point
        and type(weight) in (nn.Parameter, torch.Tensor)
    ):
        return copy.deepcopy(base).to("meta")
    return nn.Linear(lora_layer.in_features, lora_layer.out_features, bias=False, device="meta")


def initialise(
    engine: Any,
    layers: list[PlannedLayer],
    peft_config: Any,
    mode: str,
    source: Path,
    seed: int,
    loftq_bits: int | None = None,
) -> InitialAdapters:
    """Run `mode` on every planned layer (whole, on the CPU) and copy the results into the prepared model's shards
    (`loftq_bits`: LoftQ's quantization, 4 when unset)."""
    files = safetensors_files(source)
    out = InitialAdapters(mode)
    config = _single_layer_config(peft_config, mode, loftq_bits or 4)
    for layer in layers:
        name = layer.name
        module_config = copy.copy(config)  # this layer's own rank and alpha (peft's patterns may change them)
        module_config.r, module_config.lora_alpha = layer.rank, layer.alpha
        results = _initialised_layer(name, layer.template, module_config, files, seed)
        if not changes_base(mode):
            results.pop(f"{name}.base_layer.weight")
        engine.load_full_state_dict(results)
        out.weights.update({key: value for key, value in results.items() if ".lora_" in key})
    return out


def _single_layer_config(peft_config: Any, mode: str, loftq_bits: int) -> Any:
    from peft import LoftQConfig

    config = copy.deepcopy(peft_config)
    config.target_modules = {"layer"}
    config.target_parameters = None
    config.layers_to_transform = None
    config.layers_pattern = None
    config.modules_to_save = None
    config.rank_pattern, config.alpha_pattern = {}, {}
    config.task_type = None
    config.init_lora_weights = False if mode == "false" else mode
    if mode == "loftq":
        config.loftq_config = LoftQConfig(loftq_bits=loftq_bits).__dict__
    return config


def _initialised_layer(
    name: str, template: nn.Module, config: Any, files: dict[str, Path], seed: int
) -> dict[str, torch.Tensor]:
    from peft import inject_adapter_in_model

    layer = copy.deepcopy(template).to_empty(device="cpu")
    with torch.no_grad():
        for part, param in layer.named_parameters(recurse=False):
            key = base_checkpoint_name(f"{name}.base_layer.{part}")
            if key not in files:
                raise LoraInitError(f"peft_init_lora_weights: the base checkpoint has no '{key}' to start {name} from")
            with safe_open(str(files[key]), framework="pt") as handle:
                param.copy_(handle.get_tensor(key).to(param.dtype))
    holder = nn.Module()
    holder.add_module("layer", layer)
    loftq = config.init_lora_weights == "loftq"
    if loftq:  # peft's loftq_init computes on CUDA only: the same iteration runs here (`_loftq`), on any device
        config = copy.deepcopy(config)
        config.init_lora_weights = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
        inject_adapter_in_model(config, holder)
    wrapped: Any = holder.layer
    if loftq:
        _loftq(wrapped, config.loftq_config.get("loftq_bits", 4), config.loftq_config.get("loftq_iter", 1))
    return {
        f"{name}.lora_A.default.weight": wrapped.lora_A["default"].weight.detach().clone(),
        f"{name}.lora_B.default.weight": wrapped.lora_B["default"].weight.detach().clone(),
        f"{name}.base_layer.weight": wrapped.get_base_layer().weight.detach().clone(),
    }


@torch.no_grad()
def _loftq(layer: Any, bits: int, iterations: int) -> None:
    """LoftQ (Li et al., 2023) as peft's `loftq_init` runs it: alternately quantize what the adapters do not hold
    (NF4, or int8, by bitsandbytes, whose kernels run on a CPU too) and take the rank-r SVD of the quantization
    error; the base becomes the dequantized weights, the adapters the error's low-rank factors (B = L, A = R)."""
    import bitsandbytes.functional as quantization
    from peft.utils.loftq_utils import _low_rank_decomposition

    if bits not in (4, 8):
        raise LoraInitError(f"peft.loftq_config.loftq_bits: {bits}: LoftQ quantizes to 4 or 8 bits")
    base = layer.get_base_layer().weight
    weight = (base.T if layer.fan_in_fan_out else base).float()
    remainder = weight.clone()
    for step in range(iterations):
        if bits == 4:
            codes, state = quantization.quantize_4bit(remainder, quant_type="nf4", compress_statistics=False)
            dequantized = quantization.dequantize_4bit(codes, state)
        else:
            codes, scales, _ = quantization.int8_vectorwise_quant(remainder)
            dequantized = quantization.int8_vectorwise_dequant(codes, scales)
        factors = _low_rank_decomposition(weight - dequantized, reduced_rank=layer.r["default"])
        if step + 1 < iterations:
            remainder = weight - factors["L"] @ factors["R"]
    layer.lora_A["default"].weight.copy_(factors["R"])
    layer.lora_B["default"].weight.copy_(factors["L"])
    base.copy_((dequantized.T if layer.fan_in_fan_out else dequantized).to(base.dtype))


def converted_adapter(
    trained: dict[str, torch.Tensor], config: dict[str, Any], initial: InitialAdapters
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PiSSA/OLoRA adapter as one over the original base, as peft's `save_pretrained(...,
    path_initial_model_for_weight_conversion=...)` writes it: the base lost s·B₀A₀ at the start, so the update to
    the original is s·(BA − B₀A₀) = s'·[B, −B₀][A; A₀] at rank 2r, alpha doubled (× √2 under rsLoRA) so s' = s.
    `trained` holds peft's saved names (no adapter name); other modes pass through."""
    if not initial.mode.startswith(("pissa", "olora")):
        return trained, config
    start = {key.replace(".default.", "."): value for key, value in initial.weights.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in trained.items():
        first = start.get(key.removeprefix("base_model.model."))
        if first is None:
            out[key] = value
        elif ".lora_A." in key:
            out[key] = torch.cat([value, first.to(value.dtype)], dim=0)
        else:
            out[key] = torch.cat([value, -first.to(value.dtype)], dim=1)
    converted = dict(config)
    converted["init_lora_weights"] = True
    converted["r"] = 2 * config["r"]
    factor = math.sqrt(2) if config.get("use_rslora") else 2
    converted["lora_alpha"] = config["lora_alpha"] * factor
    converted["rank_pattern"] = {key: 2 * value for key, value in (config.get("rank_pattern") or {}).items()}
    converted["alpha_pattern"] = {key: factor * value for key, value in (config.get("alpha_pattern") or {}).items()}
    return out, converted
