"""The optimizer and offload that ran, read back from the prepared optimizer and model rather than from the config:
which class steps (and whose library), through which of meshkit's wrappers (ZeRO-1/2's flat chunks, NVMe pages,
tensor pieces), the state it keeps per trained element (measured after the steps), where parameters and states
live (FSDP's host offload, NVMe files) and which base layers are quantized. Words for the record of what ran."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from meshkit.models.quantized import quantized_layers
from meshkit.parallel.zero.local_shards import LocalShardOptimizer
from meshkit.parallel.zero.nvme import NVMeOptimizer
from meshkit.parallel.zero.optimizer import ZeroOptimizer
from meshkit.runtime.dtensors import local_tensor


def optimizer_chain(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """`optimizer` and every optimizer it wraps, outermost first; the last one keeps the state and steps."""
    chain = [optimizer]
    while True:
        current = chain[-1]
        inner = current.inner if isinstance(current, ZeroOptimizer) else current.__dict__.get("optimizer")
        if not isinstance(inner, torch.optim.Optimizer) or any(inner is seen for seen in chain):
            return chain
        chain.append(inner)


def optimizer_words(optimizer: torch.optim.Optimizer, stepped: bool = True) -> str:
    """`AdamW8bit (bitsandbytes), 2.3 state bytes per trained element` — with `over ZeRO-2 flat chunks`, `states
    paged to files under DIR` or `on each rank's tensor pieces` where meshkit wraps it. Before a step: the class."""
    chain = optimizer_chain(optimizer)
    stepping = chain[-1]
    words = f"{type(stepping).__name__} ({_library(stepping)})"
    for wrapper in chain:
        if isinstance(wrapper, ZeroOptimizer):
            words += f" over ZeRO-{wrapper.stage} flat chunks"
        elif isinstance(wrapper, LocalShardOptimizer):
            words += " on each rank's tensor pieces"
    nvme = next((wrapper for wrapper in chain if isinstance(wrapper, NVMeOptimizer)), None)
    elements = _trained_elements(stepping)
    if not stepped or not elements:
        return words
    if nvme is not None:
        on_disk = sum(path.stat().st_size for files in nvme.files.values() for path, _, _ in files.values())
        return f"{words}, {on_disk / elements:.1f} state bytes per trained element in files under {nvme.directory}"
    return f"{words}, {_state_bytes(stepping) / elements:.1f} state bytes per trained element"


def offload_words(model: nn.Module, optimizer: torch.optim.Optimizer | None, asked: str) -> str:
    """Where parameters and optimizer states live when the config asked for an offload (`asked`: none, cpu, nvme):
    read from FSDP's offload policy on the prepared model and from the optimizer's NVMe pages."""
    if optimizer is not None and any(isinstance(o, NVMeOptimizer) for o in optimizer_chain(optimizer)):
        return "optimizer states paged to files between steps (nvme)"
    policies = {type(policy).__name__ for policy in _fsdp_offload_policies(model)}
    if "CPUOffloadPolicy" in policies:
        return "parameters, gradients and optimizer states in host memory (FSDP CPU offload)"
    if asked == "cpu":
        return "none: on a CPU-only host everything already lives in host memory (offload=cpu asked)"
    if asked == "nvme":
        return "none: no optimizer was prepared to page (offload=nvme asked)"
    return "none"


def quantized_words(model: nn.Module) -> str | None:
    """`4-bit on 14 linear layers` for a quantized base (bitsandbytes), None for a model without any."""
    kinds = Counter(quantized_layers(model).values())
    if not kinds:
        return None
    return ", ".join(f"{kind[0]}-bit on {count} linear layer{'s' * (count != 1)}" for kind, count in kinds.items())


def _library(optimizer: torch.optim.Optimizer) -> str:
    module = type(optimizer).__module__
    return module.split(".")[0] if not module.startswith("torch.") else "torch"


def _trained_elements(optimizer: torch.optim.Optimizer) -> int:
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return sum(local_tensor(p).numel() for p in params)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors the optimizer keeps per parameter (moments, quantisation scales), this rank's pieces;
    scalar step counters left out, a tensor shared between parameters (bitsandbytes' code book) counted once."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values() if isinstance(state, dict) else ():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                total += _tensor_bytes(local_tensor(value), seen)
    return total


def _tensor_bytes(tensor: torch.Tensor, seen: set[int]) -> int:
    """A tensor's own bytes; a tensor subclass's (torchao's low-bit states) are those of the plain tensors in it."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if type(tensor) not in (torch.Tensor, nn.Parameter) and callable(flatten):
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(tensor, name), seen) for name in names)
    where = tensor.untyped_storage().data_ptr()
    if where in seen:
        return 0
    seen.add(where)
    return tensor.numel() * tensor.element_size()


def _fsdp_offload_policies(model: nn.Module) -> list[Any]:
    policies = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        if group is not None:
            policies.append(group.offload_policy)
    return policies
