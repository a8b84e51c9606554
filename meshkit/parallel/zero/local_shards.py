"""Optimizers that step plain tensors (bitsandbytes' 8-bit ones, torchao's low-bit AdamW) over DTensor parameters
(ZeRO-3, tensor parallel): each step runs on this rank's local pieces — a parameter's local shard and its
gradient's — as plain tensors sharing their storage, so the update lands in the shards. Between steps the states
stay keyed by the DTensor parameters, each holding the state of this rank's piece; checkpoints turn those pieces
back into DTensors laid out like their parameters (`meshkit.checkpoint.canonical`), so they reshard
like any optimizer's.

Blockwise 8-bit states quantize the piece a rank steps, so a sharded run tracks one process within the
quantization error (as ZeRO-1/2's flat chunks do), not exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.runtime.dtensors import local_tensor
from meshkit.training.wrapped_optimizer import WrappedOptimizer


def steps_plain_tensors(optimizer: torch.optim.Optimizer) -> bool:
    """An optimizer whose kernels cannot take DTensors (bitsandbytes'), or whose quantized states meshkit keeps
    per local piece so that checkpoints treat them alike (torchao's low-bit AdamW)."""
    return type(optimizer).__module__.split(".")[0] in ("bitsandbytes", "torchao")


@contextlib.contextmanager
def local_pieces(optimizer: Any, only: set[int] | None = None) -> Iterator[dict[int, nn.Parameter]]:
    """During the block, the optimizer's DTensor parameters (those in `only`, by id, if given) are replaced in its
    param groups by plain parameters viewing their local shards, with the local gradients, and their states follow
    them; yields id(DTensor parameter) -> its piece. Everything is put back on exit."""
    swapped: list[tuple[list[Any], int, DTensor, nn.Parameter]] = []
    for group in optimizer.param_groups:
        params = group["params"]
        for index, param in enumerate(params):
            if not isinstance(param, DTensor) or (only is not None and id(param) not in only):
                continue
            piece = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
            if param.grad is not None:
                grad = param.grad
                piece.grad = local_tensor(grad)
            if param in optimizer.state:
                optimizer.state[piece] = optimizer.state.pop(param)
            params[index] = piece
            swapped.append((params, index, param, piece))
    try:
        yield {id(param): piece for _, _, param, piece in swapped}
    finally:
        for params, index, param, piece in swapped:
            params[index] = param
            if piece in optimizer.state:
                optimizer.state[param] = optimizer.state.pop(piece)


class LocalShardOptimizer(WrappedOptimizer):
    """Steps `optimizer` on the local pieces of its DTensor parameters (see the module docstring); anything else
    (param groups, state, bitsandbytes' own methods) is the wrapped optimizer's."""

    def __getattr__(self, name: str) -> Any:  # e.g. bitsandbytes' init_state, for loading checkpoints
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        with local_pieces(self.optimizer):
            return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
