"""What a device is, in words: its name for a banner or a summary, and each GPU's memory and capabilities."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

FP8_CAPABILITY = (8, 9)  # Ada and Hopper onwards have fp8 tensor cores
BF16_CAPABILITY = (8, 0)  # Ampere onwards


def device_name(device: torch.device) -> str:
    """`cpu`, or `cuda:0 (NVIDIA H200)`."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def backend_name() -> str:
    """The default process group's backend(s), or that there is none."""
    if not dist.is_available() or not dist.is_initialized():
        return "none (no process group)"
    return str(dist.get_backend())


def sdpa_backends() -> list[str]:
    """The kernels torch's scaled_dot_product_attention may choose on CUDA: those enabled, fused ones first."""
    switches = (
        ("cudnn", "cudnn_sdp_enabled"),
        ("flash", "flash_sdp_enabled"),
        ("efficient", "mem_efficient_sdp_enabled"),
        ("math", "math_sdp_enabled"),
    )
    return [name for name, switch in switches if getattr(torch.backends.cuda, switch, lambda: False)()]


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    memory_gb: float
    capability: tuple[int, int]

    @classmethod
    def of(cls, index: int, properties: Any) -> GpuFacts:
        """From `torch.cuda.get_device_properties(index)` (or anything with the same fields)."""
        return cls(index, properties.name, properties.total_memory / 1e9, (properties.major, properties.minor))

    @property
    def bf16(self) -> bool:
        return self.capability >= BF16_CAPABILITY

    @property
    def fp8(self) -> bool:
        return self.capability >= FP8_CAPABILITY

    def describe(self) -> str:
        major, minor = self.capability
        kinds = ", ".join(kind for kind, has in (("bf16", self.bf16), ("fp8", self.fp8)) if has) or "fp16/fp32 only"
        return f"cuda:{self.index} {self.name}, {self.memory_gb:.1f} GB, sm_{major}{minor} ({kinds})"


def gpus() -> list[GpuFacts]:
    if not torch.cuda.is_available():
        return []
    return [GpuFacts.of(i, torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count())]


def cuda_versions() -> tuple[str, str]:
    """The CUDA toolkit torch was built with and NCCL's version ('none' where this build or host has neither)."""
    cuda = torch.version.cuda or "none (a CPU build of torch)"
    try:
        nccl = (
            ".".join(str(part) for part in torch.cuda.nccl.version() if part != "")
            if torch.cuda.is_available()
            else "none"
        )
    except (AttributeError, RuntimeError):
        nccl = "none"
    return cuda, nccl
