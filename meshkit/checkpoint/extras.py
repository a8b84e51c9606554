"""Per-rank state that is not a tensor of the model: random generators, as JSON."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


def _bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Python, NumPy (when installed), torch CPU and accelerator generators of this process."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": _bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy
    except ImportError:
        return state
    name, keys, position, has_gauss, cached = numpy.random.get_state()
    state["numpy"] = [name, keys.tolist(), int(position), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(s) for s in state["cuda"]])
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            return
        name, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, cached))
