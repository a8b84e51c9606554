"""Expert banks in every step's graph. A router may send none of a rank's tokens to a bank (LongCat-Flash's
zero-computation experts take whole batches of a tiny model; a small batch does the same to a list of experts),
and a parameter that gets no gradient on one rank but one on another breaks the data-parallel reduction: DDP's
reducer stops at the next step, FSDP's reduce-scatter gets buffers of different sizes. So each MoE block adds its
bank's parameters to its output with weight zero: every rank's backward reaches them, with a zero gradient where
no token came — the same sum the reduction forms. After the reduction, a bank whose gradient is zero on every rank
(no token of the whole batch reached it) loses it again (`UnreachedBanks`): the optimizer skips it, as in one
process, where such a bank has no gradient (momentum and weight decay would otherwise move it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.models.facts import ModelStructure


def tie_expert_banks(model: nn.Module, structure: ModelStructure) -> list[nn.Module]:
    """Hook every MoE block of `model` (those on this pipeline stage) that holds trainable bank parameters;
    returns their banks."""
    hooked = []
    for facts in structure.moe:
        try:
            block = model.get_submodule(facts.path)
        except AttributeError:  # (on another pipeline stage)
            continue
        bank = block.get_submodule(facts.bank)
        if any(param.requires_grad for param in bank.parameters()):
            block.register_forward_hook(_ZeroTie(bank))
            hooked.append(bank)
    return hooked


class _ZeroTie:
    """A forward hook: the block's output (a tensor, or a tuple led by one) plus zero times one element of each of
    the bank's trainable parameters (read at call time: FSDP's unsharded or expert parallel's local ones)."""

    def __init__(self, bank: nn.Module) -> None:
        self.bank = bank

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        params = [param for param in self.bank.parameters() if param.requires_grad]
        first = output[0] if isinstance(output, tuple) and output else output
        if not params or not isinstance(first, torch.Tensor) or not first.is_floating_point():
            return None
        zero = torch.stack([_local(param).reshape(-1)[0].to(first.dtype) for param in params]).sum() * 0
        tied = first + zero
        return (tied, *output[1:]) if isinstance(output, tuple) else tied


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class UnreachedBanks:
    """A gradient reducer that runs after the data-parallel reduction: the banks no token reached on any rank of
    `group` (their reduced gradients all zero) drop their gradients; one small all-reduce a step."""

    def __init__(self, banks: list[nn.Module], group: dist.ProcessGroup) -> None:
        self.banks = banks
        self.group = group

    def before_backward(self) -> None:
        """Nothing to prepare."""

    def reduce_gradients(self) -> None:
        if not self.banks:
            return
        flags = [any(param.grad is not None and bool(_local(param.grad).any()) for param in bank.parameters())
                 for bank in self.banks]  # fmt: skip
        device = next(iter(self.banks[0].parameters())).device
        reached = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(reached, op=dist.ReduceOp.MAX, group=self.group)
        for bank, anywhere in zip(self.banks, reached.tolist(), strict=True):
            if not anywhere:
                for param in bank.parameters():
                    param.grad = None
