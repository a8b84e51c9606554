"""Devices in words: a banner's and a summary's device, backend and attention; `meshkit env`'s GPU rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshkit.engine.where_it_runs import attention_words
from meshkit.models.attention_kind import attention_implementation, stores_scores
from meshkit.runtime.devices import GpuFacts, backend_name, device_name
from tests.helpers.training import tiny_gpt


def test_a_gpu_is_named_with_its_memory_and_what_its_tensor_cores_take() -> None:
    h200 = GpuFacts.of(0, SimpleNamespace(name="NVIDIA H200", total_memory=150e9, major=9, minor=0))
    assert h200.describe() == "cuda:0 NVIDIA H200, 150.0 GB, sm_90 (bf16, fp8)"
    a100 = GpuFacts.of(1, SimpleNamespace(name="NVIDIA A100-SXM4-80GB", total_memory=85.1e9, major=8, minor=0))
    assert a100.bf16 and not a100.fp8
    t4 = GpuFacts.of(2, SimpleNamespace(name="Tesla T4", total_memory=15.8e9, major=7, minor=5))
    assert t4.describe().endswith("sm_75 (fp16/fp32 only)")
    assert GpuFacts.of(3, SimpleNamespace(name="L4", total_memory=24e9, major=8, minor=9)).fp8


def test_the_cpu_and_a_run_without_a_process_group_are_named() -> None:
    assert device_name(torch.device("cpu")) == "cpu"
    if not torch.distributed.is_initialized():
        assert backend_name() == "none (no process group)"


def fake_engine(models: list, cp: int = 1, device: str = "cpu") -> SimpleNamespace:
    mesh = SimpleNamespace(dims=SimpleNamespace(cp=cp))
    return SimpleNamespace(
        mesh=mesh, ctx=SimpleNamespace(objects=SimpleNamespace(models=models)), device=torch.device(device)
    )


def test_the_attention_named_is_the_models_and_ring_attention_under_cp() -> None:
    gpt = tiny_gpt()
    assert attention_implementation(gpt) == "sdpa"
    assert attention_implementation(torch.nn.Sequential(gpt)) == "sdpa"  # (a wrapper holds the model)
    assert attention_words(fake_engine([gpt])) == "sdpa"
    assert attention_words(fake_engine([gpt], cp=2)) == "ring attention over cp=2"
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert attention_implementation(plain) is None and attention_words(fake_engine([plain])) == "the model's own"
    assert attention_words(fake_engine([])) == "the model's own"


def test_a_transformers_model_says_its_attention_in_its_config() -> None:
    hf = pytest.importorskip("tests.helpers.hf_models")
    for implementation in ("eager", "sdpa"):
        model = hf.transformers.AutoModelForCausalLM.from_config(hf.config("llama"), attn_implementation=implementation)
        assert attention_implementation(model) == implementation
    assert stores_scores("eager") and stores_scores(None)
    assert not any(stores_scores(kind) for kind in ("sdpa", "flash_attention_2", "flex_attention"))


def test_a_cuda_device_is_named_with_its_gpu_and_sdpa_with_its_enabled_kernels(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    assert device_name(torch.device("cuda", 1)) == "cuda:1 (NVIDIA H200)"
    for switch, on in (("flash_sdp_enabled", True), ("mem_efficient_sdp_enabled", False),
                       ("math_sdp_enabled", True), ("cudnn_sdp_enabled", True)):  # fmt: skip
        monkeypatch.setattr(torch.backends.cuda, switch, lambda on=on: on)
    words = attention_words(fake_engine([tiny_gpt()], device="cuda"))
    assert words == "sdpa (cudnn, flash, math enabled)"
