"""Optimizer states in the one form checkpoints hold: bitsandbytes' and torchao's low-bit states stored dequantized,
under torch's names, and quantized again on load.

An 8-bit Adam keeps each moment as uint8 codes (`state1`/`state2`) into a code book (`qmap1`/`qmap2`) with one
scale per block of 256 values (`absmax1`/`absmax2`). Blocks follow the tensor the optimizer steps — a parameter,
or a ZeRO-1/2 rank's chunk of a flat buffer — so the codes of one layout mean nothing in another. Stored as float32
`exp_avg`/`exp_avg_sq` (4 bytes per value on disk; 1 in memory), they reshard over data-parallel sizes and ZeRO
stages like any optimizer's, and even load into torch's AdamW (or back). Requantizing reproduces the codes and
scales exactly (`_requantize`), so a resumed run continues as it would have.

torchao's low-bit AdamW keeps `exp_avg`/`exp_avg_sq` as tensor subclasses (8-bit or 4-bit codes into a code book
with a scale per block, or float8 with a scale per block); they are stored as their float32 values and quantized
again into fresh buffers of the optimizer's own kind (`_torchao_states`), codes and scales exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshkit.parallel.zero.local_shards import local_pieces

BLOCK = 256  # bitsandbytes' blockwise optimizer kernels quantize states in blocks of 256
_CANONICAL = {1: "exp_avg", 2: "exp_avg_sq"}


def is_8bit_state(states: Mapping[str, Any]) -> bool:
    return "state1" in states


def is_torchao_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and type(value).__module__.split(".")[0] == "torchao"


def to_canonical(states: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's (or chunk's) optimizer state in checkpoint form (unchanged unless low-bit)."""
    if any(is_torchao_state(value) for value in states.values()):
        return {
            name: value.dequantize().float() if is_torchao_state(value) else value for name, value in states.items()
        }
    if not is_8bit_state(states):
        return dict(states)
    import bitsandbytes.functional as bnb_functional

    out: dict[str, Any] = {"step": torch.tensor(float(states.get("step", 0)))}
    for index, name in _CANONICAL.items():
        value = states.get(f"state{index}")
        if value is None:
            continue
        if value.dtype == torch.uint8:
            code, absmax = states[f"qmap{index}"], states[f"absmax{index}"]
            value = bnb_functional.dequantize_blockwise(value, absmax=absmax, code=code, blocksize=BLOCK)
        out[name] = value.float()
    return out


def from_canonical(optimizer: torch.optim.Optimizer, param: torch.Tensor, states: dict[str, Any]) -> dict[str, Any]:
    """Loaded checkpoint states for `param` in the form `optimizer` keeps (quantized for bitsandbytes; for a DTensor
    parameter, the states of this rank's local piece, as `LocalShardOptimizer` steps it)."""
    innermost: Any = optimizer
    while isinstance(getattr(innermost, "optimizer", None), torch.optim.Optimizer):  # e.g. LocalShardOptimizer
        innermost = innermost.optimizer
    torchao = type(innermost).__module__.split(".")[0] == "torchao"
    bitsandbytes = hasattr(optimizer, "init_state") and hasattr(optimizer, "name2qmap")
    if not (torchao or bitsandbytes):
        return states
    local = {key: value.to_local() if isinstance(value, DTensor) else value for key, value in states.items()}
    with local_pieces(optimizer, only={id(param)}) as pieces:
        piece = pieces.get(id(param), param)
        return _torchao_states(optimizer, piece, local) if torchao else _quantized(optimizer, piece, local)


def _torchao_states(optimizer: Any, param: torch.Tensor, states: dict[str, Any]) -> dict[str, Any]:
    """Fresh buffers of the optimizer's kind (quantized where torchao quantizes; plain float for small tensors),
    filled with the stored values."""
    step = states.get("step", 0)
    out: dict[str, Any] = {"step": torch.tensor(float(step.item() if isinstance(step, torch.Tensor) else step))}
    for name, value in states.items():
        if name == "step" or not isinstance(value, torch.Tensor):
            continue
        buffer = optimizer._new_buffer(param, name == "exp_avg")  # the first moment is signed
        _requantize_torchao(buffer, value.reshape(param.shape).to(torch.float32))
        out[name] = buffer
    return out


@torch.no_grad()
def _requantize_torchao(buffer: torch.Tensor, values: torch.Tensor) -> None:
    """`buffer.copy_(values)` quantizes with each block's largest magnitude as its scale; but the block's largest
    value was itself stored as a code of the book's end on its side, and the negative end of a signed book lies
    below 1, so the scale was max(|value| / |end code on its side|) over the block. Stating the value that attains
    it as ±scale makes the quantizer find that scale and, from it, every original code."""
    qmap, block = getattr(buffer, "qmap", None), getattr(buffer, "block_size", None)
    if qmap is None or block is None:  # plain float, or float8 (its scale is the block maximum itself)
        buffer.copy_(values)
        return
    blocks = values.reshape(-1, block).clone()
    ends = torch.where(blocks >= 0, qmap.max(), qmap.min().abs()).clamp_min(1e-12)
    scale, top = (blocks.abs() / ends).max(dim=1, keepdim=True)
    scale = _reproducing_scale(blocks, qmap, scale)
    blocks.scatter_(1, top, torch.where(blocks.gather(1, top) >= 0, scale, -scale))
    buffer.copy_(blocks.reshape(values.shape))


def _reproducing_scale(blocks: torch.Tensor, qmap: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per block, the float32 scale whose products with the block's codes are exactly its values. The quotient
    value / code may be a unit in the last place off (and two neighbouring scales may give the same top value),
    so the quotient and its neighbours are tried against the whole block."""
    middles = (qmap[1:] + qmap[:-1]) / 2
    chosen = scale.clone()
    found = torch.zeros_like(scale, dtype=torch.bool)
    for candidate in (
        scale,
        torch.nextafter(scale, torch.full_like(scale, float("inf"))),
        torch.nextafter(scale, torch.zeros_like(scale)),
    ):
        codes = torch.bucketize(blocks / candidate, middles)
        exact = (qmap[codes] * candidate == blocks).all(dim=1, keepdim=True)
        chosen = torch.where(exact & ~found, candidate, chosen)
        found |= exact
    return chosen


def _quantized(optimizer: Any, param: torch.Tensor, states: dict[str, Any]) -> dict[str, Any]:
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, candidate in enumerate(group["params"]):
            if candidate is param:
                optimizer.state.pop(param, None)
                optimizer.init_state(group, param, group_index, param_index)
                fresh = optimizer.state[param]
                for index, name in _CANONICAL.items():
                    target, value = fresh.get(f"state{index}"), states.get(name)
                    if target is None or value is None:
                        continue
                    value = value.reshape(target.shape).to(torch.float32)
                    if target.dtype == torch.uint8:
                        _requantize(value, fresh[f"qmap{index}"], target, fresh[f"absmax{index}"])
                    else:
                        target.copy_(value)
                step = states.get("step")
                fresh["step"] = int(step.item() if isinstance(step, torch.Tensor) else step or 0)
                return fresh
    raise KeyError("the parameter is not in the optimizer's param groups")


@torch.no_grad()
def _requantize(values: torch.Tensor, code: torch.Tensor, out: torch.Tensor, absmax: torch.Tensor) -> None:
    """Codes and block scales for dequantized `values`, exactly the ones they came from: the block's largest value
    was stored as a code below 1 (the signed book tops out under 1.0), so the scale is the block maximum divided
    by that code, not the maximum itself."""
    import bitsandbytes.functional as bnb_functional

    bnb_functional.quantize_blockwise(values, code=code, absmax=absmax, out=out, blocksize=BLOCK)
    flat = values.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    blocks = torch.nn.functional.pad(flat.abs(), (0, pad)).reshape(-1, BLOCK)
    codes = torch.nn.functional.pad(out.reshape(-1).long(), (0, pad)).reshape(-1, BLOCK)
    top = codes.gather(1, blocks.argmax(dim=1, keepdim=True)).squeeze(1)
    top_code = code[top].abs()
    absmax.copy_(torch.where(top_code > 0, absmax / top_code.clamp_min(1e-12), absmax))


def restore_settings(group: dict[str, Any], saved: dict[str, Any]) -> None:
    """A param group's saved settings (learning rate, betas, ...) back into `group`; a 0-d tensor setting (torchao
    keeps its learning rate so) is filled in place: the optimizer keeps that tensor and may have compiled against it."""
    for key, value in saved.items():
        current = group.get(key)
        if isinstance(current, torch.Tensor) and current.dim() == 0:
            current.fill_(value)
        else:
            group[key] = tuple(value) if isinstance(current, tuple) else value
