"""Optimizer states in the one form checkpoints hold: bitsandbytes' 8-bit states stored dequantized, under torch's
names, and quantized again on load.

An 8-bit Adam keeps each moment as uint8 codes (`state1`/`state2`) into a code book (`qmap1`/`qmap2`) with one
scale per block of 256 values (`absmax1`/`absmax2`). Blocks follow the tensor the optimizer steps — a parameter,
or a ZeRO-1/2 rank's chunk of a flat buffer — so the codes of one layout mean nothing in another. Stored as float32
`exp_avg`/`exp_avg_sq` (4 bytes per value on disk; 1 in memory), they reshard over data-parallel sizes and ZeRO
stages like any optimizer's, and even load into torch's AdamW (or back). Requantizing reproduces the codes and
scales exactly (`_requantize`), so a resumed run continues as it would have.
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


def to_canonical(states: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's (or chunk's) optimizer state in checkpoint form (unchanged unless bitsandbytes')."""
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
    if not hasattr(optimizer, "init_state") or not hasattr(optimizer, "name2qmap"):  # not bitsandbytes'
        return states
    local = {key: value.to_local() if isinstance(value, DTensor) else value for key, value in states.items()}
    with local_pieces(optimizer, only={id(param)}) as pieces:
        return _quantized(optimizer, pieces.get(id(param), param), local)


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
