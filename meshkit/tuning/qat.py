"""Quantization-aware training (Axolotl's `qat:` block) through torchao: the model's Linear layers (and with
`quantize_embedding` its embeddings) become torchao's fake-quantized modules, which round their weights — and
activations, where an activation dtype is given — to the target format in the forward pass and let the gradient
through unchanged; the weights themselves stay in full precision, under the same names, so every layout shards
and checkpoints them as before and `merged/` holds the trained full-precision weights (Axolotl converts the model
back the same way), ready for post-training quantization to the format trained for.

The combinations are Axolotl's (`src/axolotl/utils/quantization.py`): int4 weights alone or with int8 / float8
activations, float8 weights and activations, mxfp4; `fake_quant_after_n_steps` trains the first steps without the
rounding. NVFP4's fake quantization runs torchao's NVFP4 matmul, which only a Blackwell GPU has; elsewhere the
layer rounds its input and weight with torchao's own NVFP4 quantizer and multiplies the rounded values in the
layer's dtype (`_nvfp4_emulated`), with torchao's backward.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from meshkit.config.section import Section
from meshkit.core.errors import MeshkitError
from meshkit.models.facts import tied_parameters

QuantDType = Literal["int4", "int8", "float8_e4m3fn", "nvfp4", "mxfp4"]
DTYPE_NAMES = {"int4": "int4", "int8": "int8", "float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn",
               "float8": "float8_e4m3fn", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}  # fmt: skip


class QATError(MeshkitError):
    """A `qat:` combination torchao's quantization-aware training does not have, or this device cannot run."""


class QATSettings(Section):
    """Axolotl's `qat:` block."""

    activation_dtype: QuantDType | None = Field(None, description="activations fake-quantized to; null = none")
    weight_dtype: QuantDType = Field("int8", description="weights fake-quantized to")
    quantize_embedding: bool = Field(False, description="the embeddings' weights too")
    group_size: int | None = Field(32, ge=1, description="elements per scale of the weights' groups")
    fake_quant_after_n_steps: int | None = Field(None, ge=0, description="steps trained before fake quantization")

    @field_validator("activation_dtype", "weight_dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        if value is None or not isinstance(value, str):
            return value
        if value not in DTYPE_NAMES:
            raise ValueError(f"'{value}' is not a QAT dtype: choose int4, int8, float8_e4m3fn (fp8), nvfp4 or mxfp4")
        return DTYPE_NAMES[value]

    def describe(self) -> str:
        weights = f"{self.weight_dtype} weights" + (f" (groups of {self.group_size})" if self.group_size else "")
        acts = f", {self.activation_dtype} activations" if self.activation_dtype else ""
        later = f", from step {self.fake_quant_after_n_steps}" if self.fake_quant_after_n_steps else ""
        emulated = (
            " (no NVFP4 matmul off a Blackwell GPU: torchao's rounding, the product in the layer's dtype)"
            if "nvfp4" in (self.weight_dtype, self.activation_dtype)
            else ""
        )
        return f"quantization-aware training: {weights}{acts} fake-quantized (torchao){later}{emulated}"


def _configs(qat: QATSettings, device: torch.device) -> tuple[Any, Any]:
    """(torchao's QATConfig for the Linear layers, for the embeddings: weights only)."""
    from torchao.quantization.qat import QATConfig
    from torchao.quantization.qat.fake_quantize_config import (
        Float8FakeQuantizeConfig,
        Int4WeightFakeQuantizeConfig,
        IntxFakeQuantizeConfig,
    )

    weight, activation, group = qat.weight_dtype, qat.activation_dtype, qat.group_size
    if weight == "int8":
        raise QATError("qat: int8 weights are not a torchao QAT configuration (as in Axolotl): use weight_dtype int4")
    if weight == "int4" and activation == "int4":
        raise QATError("qat: int4 activations with int4 weights are not a torchao QAT configuration")
    if weight == "mxfp4" or activation == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        if (group or 32) != 32:
            raise QATError("qat: mxfp4 scales blocks of 32 elements: group_size: 32")
        if qat.quantize_embedding:
            raise QATError(
                "qat: torchao fake-quantizes embeddings to int4 or float8, not mxfp4: quantize_embedding: false"
            )
        mx = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=32)
        return QATConfig(activation_config=mx, weight_config=mx), None
    if weight == "nvfp4" or activation == "nvfp4":
        if (group or 16) != 16:
            raise QATError("qat: nvfp4 scales blocks of 16 elements: group_size: 16")
        from torchao.prototype.qat import NVFP4FakeQuantizeConfig

        if qat.quantize_embedding:
            raise QATError(
                "qat: torchao fake-quantizes embeddings to int4 or float8, not nvfp4: quantize_embedding: false"
            )
        nv = NVFP4FakeQuantizeConfig()
        return QATConfig(activation_config=nv, weight_config=nv), None
    if weight == "float8_e4m3fn":
        if activation not in (None, "float8_e4m3fn"):
            raise QATError(f"qat: float8 weights go with float8 activations or none, not {activation}")
        fp8 = Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)
        return QATConfig(weight_config=fp8, activation_config=fp8 if activation else None), QATConfig(weight_config=fp8)
    # int4 weights: alone, or with int8 (per token, asymmetric) or float8 activations
    sizes = {"group_size": group} if group else {}
    compute = {"int8": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}.get(activation or "")
    weights = Int4WeightFakeQuantizeConfig(**sizes, **({"activation_dtype": compute} if compute else {}))
    acts: Any = None
    if activation == "int8":
        acts = IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False)
    elif activation == "float8_e4m3fn":
        acts = Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)
    int4 = getattr(torch, "int4")  # noqa: B009 - (torch has the dtype; its stubs do not)
    embedding = QATConfig(weight_config=IntxFakeQuantizeConfig(dtype=int4, group_size=group or 32))
    return QATConfig(weight_config=weights, activation_config=acts), embedding


def prepare_for_qat(model: torch.nn.Module, qat: QATSettings, device: torch.device) -> None:
    """Swap `model`'s Linear layers (and embeddings, when asked) for torchao's fake-quantized ones, in place."""
    try:
        from torchao.quantization import quantize_
    except ImportError:
        raise QATError("qat: needs torchao: pip install 'meshkit[hf]'") from None
    linear, embedding = _configs(qat, device)
    tied = tied_parameters(model)  # (a swap on the meta device gives each new layer a weight of its own)
    quantize_(model, linear)
    if qat.quantize_embedding and embedding is not None:
        quantize_(model, embedding, filter_fn=lambda module, _name: isinstance(module, torch.nn.Embedding))
    for names in tied:  # a head tied to the embedding stays tied, as in a model swapped after it loaded
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, shared)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and _is_low_precision_linear(module):
            module.forward = partial(_low_precision_forward, module, type(module).forward)  # type: ignore[method-assign]  # per instance


def _is_low_precision_linear(module: torch.nn.Module) -> bool:
    """torchao's MX / NVFP4 fake-quantized Linear: no quantizer objects (so no switch of their own), and a forward
    that needs its input and weight in one dtype."""
    return (
        isinstance(module, torch.nn.Linear)
        and hasattr(module, "to_linear")
        and not hasattr(module, "weight_fake_quantizer")
    )


class _InDtype:
    """A module's attributes as its forward reads them, with the weight and bias cast to `dtype`."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        self._module, self._dtype = module, dtype

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        return value.to(self._dtype) if name in ("weight", "bias") and value is not None else value


def _low_precision_forward(module: torch.nn.Linear, forward: Any, x: torch.Tensor) -> torch.Tensor:
    """The layer's fake-quantized forward, or the plain Linear's while fake quantization is off
    (`fake_quant_after_n_steps`); under autocast (the run's bf16 / fp16) in the autocast dtype, as the layer
    itself would run under a bf16 model."""
    if not module.__dict__.get("fake_quant_enabled", True):
        return torch.nn.functional.linear(x, module.weight, module.bias)
    if type(module).__name__ == "NVFP4FakeQuantizedLinear" and not has_nvfp4_matmul(x.device):
        forward = _nvfp4_emulated
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return forward(module, x)
    dtype = torch.get_autocast_dtype(kind)
    with torch.autocast(kind, enabled=False):
        return forward(_InDtype(module, dtype), x.to(dtype))


def has_nvfp4_matmul(device: torch.device) -> bool:
    """A Blackwell GPU (compute capability 10 or later): torchao's NVFP4 matmul runs there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


def _rounded_nvfp4(tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """`tensor` rounded to NVFP4 as torchao rounds it (blocks of 16 on the last dim, fp8 block scales, a per-tensor
    scale when the config asks), in its own dtype."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    values = tensor.detach()
    scale = per_tensor_amax_to_scale(values.abs().max()) if config.use_per_tensor_scale else None
    quantized = NVFP4Tensor.to_nvfp4(values, per_tensor_scale=scale, is_swizzled_scales=False, use_triton_kernel=False)
    return quantized.dequantize(tensor.dtype)


def _nvfp4_emulated(module: Any, x: torch.Tensor) -> torch.Tensor:
    """torchao's NVFP4 fake-quantized Linear without its NVFP4 matmul: input and weight rounded by torchao's
    quantizer, multiplied in the layer's dtype; the gradient is torchao's (each operand's rounded value times the
    other's gradient, straight through the rounding)."""
    flat = x.reshape(-1, x.shape[-1])
    inputs = flat + (_rounded_nvfp4(flat, module.activation_config) - flat).detach()
    weight = module.weight + (_rounded_nvfp4(module.weight, module.weight_config) - module.weight).detach()
    return torch.nn.functional.linear(inputs, weight, module.bias).reshape(*x.shape[:-1], -1)


def _toggle(module: torch.nn.Module, enabled: bool) -> None:
    """Fake quantization on or off: by the quantizers' own switch, or (torchao's MX / NVFP4 linear layers have
    none) by the flag their forward here reads."""
    for name in ("weight_fake_quantizer", "activation_fake_quantizer"):
        quantizer = getattr(module, name, None)
        if quantizer is not None and hasattr(quantizer, "enabled"):
            quantizer.enabled = enabled
    if _is_low_precision_linear(module):
        module.__dict__["fake_quant_enabled"] = enabled


def fake_quant_switch(model: torch.nn.Module, qat: QATSettings) -> Callable[[int], None] | None:
    """`fake_quant_after_n_steps`: before each step, fake quantization on from that step (off before it); None
    when it is on throughout."""
    start = qat.fake_quant_after_n_steps
    if not start:
        return None

    def before_step(step: int) -> None:
        model.apply(partial(_toggle, enabled=step >= start))

    return before_step
