"""Liger's kernels (Axolotl's `liger_rope`, `liger_rms_norm`, `liger_glu_activation`, `liger_layer_norm`):
Triton GPU kernels for RoPE, RMSNorm, SwiGLU/GeGLU and LayerNorm, applied to the model through the `liger-kernel`
package (its own patching, by the model's type) where the run is on CUDA and the package is installed; elsewhere
the model's own modules run (the same maths) and one notice line says so. Liger's cross-entropy kernels are not
applied: meshkit's fused loss computes the loss (`fused_loss`)."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from meshkit.config.section import Section


class LigerSettings(Section):
    """Which of Liger's kernels to apply (on CUDA, with liger-kernel installed)."""

    liger_rope: bool = Field(False, description="Liger's RoPE kernel")
    liger_rms_norm: bool = Field(False, description="Liger's RMSNorm kernel")
    liger_glu_activation: bool = Field(False, description="Liger's SwiGLU / GeGLU MLP kernel")
    liger_layer_norm: bool = Field(False, description="Liger's LayerNorm kernel")


def liger_asked(settings: LigerSettings) -> str:
    """The Liger kernels asked for, by key (`liger_rope, liger_rms_norm`); empty when none."""
    keys = ("rope", "rms_norm", "glu_activation", "layer_norm")
    return ", ".join(f"liger_{name}" for name in keys if getattr(settings, f"liger_{name}"))


def apply_liger_kernels(model: Any, settings: LigerSettings, device: torch.device) -> str | None:
    """Apply the kernels asked for to `model` (a transformers model, before adapters wrap it); returns a notice
    line where they cannot run here, None otherwise."""
    asked = {
        "rope": settings.liger_rope,
        "rms_norm": settings.liger_rms_norm,
        "swiglu": settings.liger_glu_activation,
        "geglu": settings.liger_glu_activation,  # (Liger names the MLP kernel by the model's activation)
        "layer_norm": settings.liger_layer_norm,
    }
    names = liger_asked(settings)
    if not names:
        return None
    if device.type != "cuda":
        return (
            f"{names}: Liger's kernels are Triton GPU kernels: no effect on {device.type} (the model's own modules run)"
        )
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return f"{names}: liger-kernel is not installed (pip install liger-kernel): the model's own modules run"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"{names}: Liger has no kernels for model type {model_type}: the model's own modules run"
    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False, **asked)
    return None
