"""Apply a function to every tensor in a nested batch (tensors inside dicts, lists and tuples)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Same structure as `data`, with `fn` applied to each tensor; other leaves are returned unchanged."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        mapped = {key: map_tensors(fn, value) for key, value in data.items()}
        return cast(Any, type(data))(mapped)  # (a dict subclass takes a dict)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(fn, value) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(fn, value) for value in data)
    return data


def to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor of a batch to `device` (asynchronously where the source memory is pinned)."""
    return map_tensors(lambda t: t.to(device, non_blocking=t.is_pinned()), data)


def has_tensors(data: Any) -> bool:
    """True if a nested structure holds at least one tensor."""
    found: list[bool] = []
    map_tensors(lambda t: found.append(True), data)
    return bool(found)
