"""A fact every tensor-parallel layout relies on, checked at its first use: a parameter kept whole on every tp rank
ends each window with the same gradient on every tp rank (split layers' inputs summed, whole layers inside split
regions summed, norms on sequence shards summed). A model whose structure breaks it (an input per head the plan
did not slice, a whole layer between split ones) would train silently wrong: the first window's gradients are
compared over tp (two numbers per parameter, once) and a difference stops the run in one line that names it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.parallel.tensor.auto import TensorParallelError

RELATIVE = 1e-5


class WholeGradientsAgree:
    """A gradient reducer that runs last, once: the whole parameters' gradients must agree over `group`."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup) -> None:
        self.named = [(name, param) for name, param in named if _whole(param)]
        self.group = group
        self.checked = False

    def before_backward(self) -> None:
        """Nothing to prepare."""

    def reduce_gradients(self) -> None:
        if self.checked:
            return
        present = [(name, grad) for name, param in self.named if (grad := _whole_gradient(param)) is not None]
        if not present:
            return
        self.checked = True
        sums = torch.stack([torch.stack([g.double().sum(), g.double().square().sum()]) for _, g in present])
        gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, sums, group=self.group)
        every = torch.stack(gathered)  # [ranks, params, 2]
        spread = (every - every[:1]).abs().amax(dim=0)
        scale = every.abs().amax(dim=0).clamp_min(1e-30)
        wrong = ((spread > RELATIVE * scale) & (scale > 1e-12)).any(dim=1).nonzero().flatten().tolist()
        if wrong:
            name = present[wrong[0]][0]
            raise TensorParallelError(
                f"tensor parallel: the gradient of {name} (whole on every tp rank) differs between the tp ranks at "
                f"the first step ({len(wrong)} such parameter(s)), so this model's split is not exact: set "
                "tensor_parallel.plan to keep its layers whole, or use tp=1"
            )


def _whole(param: torch.Tensor) -> bool:
    """Whole on every tp rank: a plain tensor, or a DTensor replicated over every mesh dim (sequence parallel's
    norms and embeddings)."""
    return not isinstance(param, DTensor) or all(placement.is_replicate() for placement in param.placements)


def _whole_gradient(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient as each rank holds it, where it is meant to be the same on every rank (a replicated DTensor's
    local value); None where there is none, or where it is still a partial sum (nothing to compare)."""
    grad = param.grad
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        return grad.to_local() if all(placement.is_replicate() for placement in grad.placements) else None
    return grad
