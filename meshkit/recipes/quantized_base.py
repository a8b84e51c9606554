"""A quantized, frozen base for LoRA: `load_in_8bit` (LLM.int8), `load_in_4bit` / `adapter: qlora` (NF4 or FP4,
double quantization, a compute dtype) through transformers' `BitsAndBytesConfig`, and `gptq: true` bases through
transformers' GPTQ integration where its kernels are installed.

transformers loads the base and quantizes each weight as it streams in; peft then wraps the quantized layers
(`Linear4bit` / `Linear8bitLt`) in LoRA layers that train in float32. bitsandbytes 0.50 runs both kinds on a
CPU. The adapters train in one process, DDP and ZeRO-1/2 (each rank holds the whole quantized base: 4 bits are
about a quarter of bf16), and over a 4-bit base in ZeRO-3 too: FSDP2 shards the packed weights as they are (uint8
storage; bitsandbytes re-attaches each layer's quantization state to the gathered weight), so each rank holds 1/n of
the base (`bench/finetune.py` measures it), and neither a float storage dtype nor torchao's NF4 tensor is needed.
An int8 layer keeps its scales on its weight, which a shard loses: int8 bases stop at ZeRO-2. The merged export
dequantizes the base and folds the adapters in (`meshkit.models.quantized`).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
from torch import nn

from meshkit.core.errors import MeshkitError
from meshkit.models.quantized import keep_training_layout, quantized_kind
from meshkit.recipes.hf_base import load_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


class _CastNotice(logging.Filter):
    """bitsandbytes logs its int8 input cast on every matmul; the recipe says it once instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast from" not in record.getMessage()


INT8_CAST_NOTE = "load_in_8bit: LLM.int8 matmuls quantize their inputs through float16 (bitsandbytes)"


class QuantizedBaseError(MeshkitError):
    """A quantized base that cannot load or train here; the message says what to change."""


def quantization_config(settings: Any) -> Any:
    """transformers' `BitsAndBytesConfig` for the settings' `load_in_8bit` / 4-bit keys (None for gptq)."""
    if settings.quantization == "gptq":
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise QuantizedBaseError(f"a {settings.quantization} base needs bitsandbytes: pip install 'meshkit[hf]'")
    from transformers import BitsAndBytesConfig

    options: dict[str, Any] = dict(settings.bnb_config_kwargs or {})
    if settings.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, **options)
    compute = _DTYPES[settings.bnb_4bit_compute_dtype or "float32"]
    return BitsAndBytesConfig(
        **{
            "load_in_4bit": True,
            "bnb_4bit_quant_type": settings.bnb_4bit_quant_type,
            "bnb_4bit_use_double_quant": settings.bnb_4bit_use_double_quant,
            "bnb_4bit_compute_dtype": compute,
            "bnb_4bit_quant_storage": _DTYPES[settings.bnb_4bit_quant_storage or "uint8"],
            **options,
        }
    )


def check_layout(settings: Any, zero_stage: int, tp: int, pp: int, precision: str = "no") -> None:
    """The layouts a quantized base trains in, said before it loads."""
    if not settings.quantization:
        return
    what = {"8bit": "load_in_8bit", "4bit": "load_in_4bit / qlora", "gptq": "gptq"}[settings.quantization]
    if zero_stage == 3 and settings.quantization != "4bit":
        raise QuantizedBaseError(
            f"{what}: ZeRO-3 shards 4-bit layers only (int8 layers keep their scales on the weight, which a shard "
            "loses): use load_in_4bit / qlora, or zero_stage 1 or 2"
        )
    storage = settings.bnb_4bit_quant_storage or "uint8"
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    if zero_stage == 3 and storage not in ("uint8", compute):
        raise QuantizedBaseError(
            f"bnb_4bit_quant_storage: {storage} under ZeRO-3 with precision {precision}: FSDP casts floating "
            f"parameters to {compute}, which garbles packed 4-bit weights: store them as uint8 (the default) or "
            f"{compute}"
        )
    if tp > 1 or pp > 1:
        raise QuantizedBaseError(
            f"{what}: quantized layers run whole on each rank, not split by tensor or pipeline parallel: "
            "set tp=1 and pp=1 (data parallel and ZeRO-1/2 train the adapters)"
        )


def load_quantized_base(settings: Any, attention: str | None, device: torch.device) -> nn.Module:
    """The base model, quantized as it loads onto `device`; every parameter frozen."""
    if settings.quantization == "gptq" and importlib.util.find_spec("gptqmodel") is None:
        raise QuantizedBaseError(
            "gptq: true loads GPTQ checkpoints through the gptqmodel package, which is not installed: "
            "pip install gptqmodel, or load the unquantized base with load_in_4bit: true (QLoRA)"
        )
    config = quantization_config(settings)
    if settings.quantization == "8bit":
        bnb_log = logging.getLogger("bitsandbytes.autograd._functions")
        if not any(isinstance(f, _CastNotice) for f in bnb_log.filters):
            bnb_log.addFilter(_CastNotice())
    model = load_model(settings, attention, device, **({"quantization_config": config} if config else {}))
    for param in model.parameters():
        param.requires_grad_(False)
    keep_training_layout(model)
    if settings.quantization == "8bit":
        for module in model.modules():
            if quantized_kind(module) == "8bit":
                module.register_forward_pre_hook(_at_most_three_dims)
                module.register_forward_hook(_leading_dims_back)
    return model


def _at_most_three_dims(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """bitsandbytes' int8 matmul takes inputs of 2 or 3 dims; a model that projects a 4-D tensor (Kimi-Linear's
    [batch, 1, seq, rank] latents) gets its leading dims folded into one here and back after (`_leading_dims_back`)."""
    inputs = args[0] if args else None
    if not isinstance(inputs, torch.Tensor) or inputs.dim() <= 3:
        return None
    module.__dict__["_meshkit_leading_dims"] = inputs.shape[:-1]  # (read once by the forward hook, then dropped)
    return (inputs.reshape(-1, inputs.shape[-1]), *args[1:])


def _leading_dims_back(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    leading = module.__dict__.pop("_meshkit_leading_dims", None)
    if leading is None or not isinstance(output, torch.Tensor):
        return None
    return output.reshape(*leading, output.shape[-1])
