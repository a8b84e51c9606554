"""Liger's kernels (`liger_rope`, `liger_rms_norm`, `liger_glu_activation`, `liger_layer_norm`): applied through the
liger-kernel package on CUDA where it is installed, one notice line everywhere else."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from meshkit.tuning.liger import LigerSettings, apply_liger_kernels

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_models import causal_lm  # noqa: E402

ASKED = LigerSettings(liger_rope=True, liger_glu_activation=True)


def _fake_liger(monkeypatch: Any, calls: list[dict[str, Any]], types_known: tuple[str, ...] = ("llama",)) -> None:
    package = types.ModuleType("liger_kernel")
    transformers_part = types.ModuleType("liger_kernel.transformers")
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    transformers_part._apply_liger_kernel_to_instance = lambda **kwargs: calls.append(kwargs)  # type: ignore[attr-defined]
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = dict.fromkeys(types_known)  # type: ignore[attr-defined]
    for name, module in (("liger_kernel", package), ("liger_kernel.transformers", transformers_part),
                         ("liger_kernel.transformers.monkey_patch", monkey_patch)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)


def test_on_cuda_with_liger_installed_its_kernels_are_applied_as_asked(monkeypatch: Any) -> None:
    calls: list[dict[str, Any]] = []
    _fake_liger(monkeypatch, calls)
    model = causal_lm("llama")
    assert apply_liger_kernels(model, ASKED, torch.device("cuda", 0)) is None
    assert calls == [{"model": model, "cross_entropy": False, "fused_linear_cross_entropy": False, "rope": True,
                      "rms_norm": False, "swiglu": True, "geglu": True, "layer_norm": False}]  # fmt: skip


def test_elsewhere_one_notice_line_names_the_keys_and_why(monkeypatch: Any) -> None:
    model = causal_lm("llama")
    on_cpu = apply_liger_kernels(model, ASKED, torch.device("cpu"))
    assert (
        on_cpu is not None and on_cpu.startswith("liger_rope, liger_glu_activation: ") and "no effect on cpu" in on_cpu
    )
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # (not installed)
    missing = apply_liger_kernels(model, ASKED, torch.device("cuda", 0))
    assert missing is not None and "pip install liger-kernel" in missing
    calls: list[dict[str, Any]] = []
    _fake_liger(monkeypatch, calls, types_known=("mistral",))
    unknown = apply_liger_kernels(model, ASKED, torch.device("cuda", 0))
    assert unknown is not None and "no kernels for model type llama" in unknown and not calls
    assert apply_liger_kernels(model, LigerSettings(), torch.device("cuda", 0)) is None
    assert all("\n" not in line for line in (on_cpu, missing, unknown))
