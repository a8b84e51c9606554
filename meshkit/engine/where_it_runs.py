"""Where a run ran, in words for its banner and summary: the device, the process group's backend(s), the
attention computation the model takes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit.models.attention_kind import attention_implementation
from meshkit.runtime.devices import backend_name, device_name, sdpa_backends

if TYPE_CHECKING:
    from meshkit.engine.engine import Engine


def attention_words(engine: Engine) -> str:
    """`sdpa`, `eager`, `flash_attention_2`, ...; on CUDA with the SDPA kernels enabled; ring attention under cp."""
    cp = engine.mesh.dims.cp
    if cp > 1:
        return f"ring attention over cp={cp}"
    models = engine.ctx.objects.models
    found = {attention_implementation(model) for model in models} if models else {None}
    words = ", ".join(sorted(kind or "the model's own" for kind in found))
    if found == {"sdpa"} and engine.device.type == "cuda":
        words += f" ({', '.join(sdpa_backends()) or 'no fused kernel'} enabled)"
    return words


def where_it_runs(engine: Engine) -> dict[str, str]:
    """{'device': 'cuda:0 (NVIDIA H200)', 'backend': 'cpu:gloo,cuda:nccl', 'attention': 'sdpa (...)'}."""
    return {"device": device_name(engine.device), "backend": backend_name(), "attention": attention_words(engine)}


def where_words(engine: Engine) -> str:
    """One phrase for a banner: `on cpu (gloo), attention sdpa`."""
    where = where_it_runs(engine)
    return f"on {where['device']} ({where['backend']}), attention {where['attention']}"
