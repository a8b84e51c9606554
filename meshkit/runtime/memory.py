"""What a rank actually holds: bytes of parameter, gradient and optimizer-state storage, and peak RSS."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from meshkit.runtime.dtensors import local_tensor


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; shards count locally).

    `seen` carries storages already counted elsewhere, so a buffer shared by two categories counts once.
    """
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        local = local_tensor(tensor)
        if is_traceable_wrapper_subclass(local):  # e.g. torchao's quantized optimizer states: count their parts
            names, _ = local.__tensor_flatten__()
            total += storage_bytes((getattr(local, name) for name in names), seen)
            continue
        if local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _state_tensors(state: Any) -> Iterable[torch.Tensor]:
    for value in state.values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            yield from _state_tensors(value)


def peak_rss_bytes() -> int:
    """The process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def memory_report(models: list[torch.nn.Module], optimizers: list[Any]) -> dict[str, int]:
    """Bytes held by this rank: `params`, `grads` (the models' and the optimizers' own, e.g. ZeRO-2 chunks),
    `optimizer` (state tensors resident now), plus `rss` and `peak_rss`."""
    seen: set[int] = set()
    params = [p for model in models for p in model.parameters()]
    shard_params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    report = {"params": storage_bytes(params, seen)}
    storage_bytes(shard_params, seen)  # ZeRO chunks are views of the parameters: never count them twice
    grads = [p.grad for p in [*params, *shard_params] if p.grad is not None]
    report["grads"] = storage_bytes(grads, seen)
    report["optimizer"] = storage_bytes((t for opt in optimizers for t in _state_tensors(opt.state)), seen)
    report["rss"] = current_rss_bytes()
    report["peak_rss"] = max(peak_rss_bytes(), report["rss"])  # the kernel updates ru_maxrss lazily
    return report
