"""Tied weights across pipeline stages (an input embedding that is also the LM head).

Under a pipeline the first stage holds the embedding and the last the head: two copies of one tensor. Both
start equal (every rank builds the same model); after each backward their gradients are summed over the
pipeline group, so both copies take the same optimizer step and stay equal. Stages holding neither copy
join the sum with zeros.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshkit.models.structure import ModelStructure
from meshkit.runtime import collectives
from meshkit.runtime.dtensors import local_tensor
from meshkit.runtime.mesh import ParallelMesh


class TiedAcrossStages:
    """Sums the gradients of each tied group's copies over the pipeline group (a `GradientSync` reducer)."""

    def __init__(self, model: nn.Module, structure: ModelStructure, mesh: ParallelMesh) -> None:
        self.group = mesh.group("pp")
        mine = dict(model.named_parameters(remove_duplicate=False))
        self.copies: list[list[nn.Parameter]] = []
        # copies held under a name other than their group's first: a clip norm must count them only once
        self.counted_elsewhere = {
            id(p) for names in structure.tied for n in names[1:] if (p := mine.get(n)) is not None
        }
        self.counted_elsewhere -= {id(p) for names in structure.tied if (p := mine.get(names[0])) is not None}
        local_shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        for index, names in enumerate(structure.tied):
            params = list({id(p): p for name in names if (p := mine.get(name)) is not None}.values())
            self.copies.append(params)
            if params:
                local_shapes[index] = (tuple(local_tensor(params[0]).shape), params[0].dtype)
        shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        for part in collectives.gather_object(local_shapes, self.group):
            shapes.update(part)
        self.shapes = [shapes[index] for index in range(len(structure.tied))]
        self.device = mesh.device

    def before_backward(self) -> None:
        """Nothing to prepare: gradients accumulate in place until the window ends."""

    def reduce_gradients(self) -> None:
        for params, (shape, dtype) in zip(self.copies, self.shapes, strict=True):
            total = torch.zeros(shape, dtype=dtype, device=self.device)
            for param in params:
                if param.grad is not None:
                    total += local_tensor(param.grad)
            dist.all_reduce(total, group=self.group)
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                local_tensor(param.grad).copy_(total)
