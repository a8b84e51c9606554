"""State that is not a tensor of the model, as JSON: random generators, and the objects registered with
`engine.register_for_checkpointing` (their `state_dict()`, tensors included, without pickle)."""

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
    numpy_state: Any = numpy.random.get_state()  # (legacy=True: a tuple)
    name, keys, position, has_gauss, cached = numpy_state
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


_TENSOR, _TUPLE, _PAIRS = "__tensor__", "__tuple__", "__pairs__"


def state_to_json(value: Any, where: str) -> Any:
    """A `state_dict()` as JSON, exactly (tensors as raw bytes with dtype and shape, tuples and non-string keys
    kept); anything else fails with a message naming `where` and the key, since it would need pickle."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        return {_TENSOR: [str(flat.dtype).removeprefix("torch."), list(value.shape), _bytes(flat.view(torch.uint8))]}
    if isinstance(value, (list, tuple)):
        items = [state_to_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: state_to_json(item, f"{where}[{key!r}]") for key, item in value.items()}
        return {_PAIRS: [[state_to_json(k, where), state_to_json(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(
        f"{where} is a {type(value).__name__}, which cannot be saved without pickle: let state_dict() return "
        "numbers, strings, lists, dicts or tensors"
    )


def state_from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [state_from_json(item) for item in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        dtype, shape, data = value[_TENSOR]
        return _tensor(data).view(getattr(torch, dtype)).reshape(shape)
    if _TUPLE in value:
        return tuple(state_from_json(item) for item in value[_TUPLE])
    if _PAIRS in value:
        return {state_from_json(k): state_from_json(v) for k, v in value[_PAIRS]}
    return {key: state_from_json(item) for key, item in value.items()}
