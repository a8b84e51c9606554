"""Norms over a whole split projection (OLMo-2's q_norm and k_norm), split with the heads.

Such a norm takes its statistics (the mean square) over every head of the projection. Under tensor parallel the
projection is column-split, so each rank holds its heads' features only: the norm's weight is split the same way
(a DTensor, Shard(0)) and its input is seen as the rank's part of the whole (Shard(-1)), so the norm's own
forward — unchanged — computes the mean over the whole width (DTensor sums the parts over tp) and returns this
rank's features. Gradients follow through DTensor's autograd.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_module, distribute_tensor

from meshkit.models.facts import AttentionFacts


def _split_weight(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        split = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, split)


def _inputs_as_parts(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    hidden, *rest = inputs
    return (DTensor.from_local(hidden, mesh, [Shard(hidden.dim() - 1)], run_check=False), *rest)


def _local_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
    return output.to_local()


def split_projection_norms(model: nn.Module, attention: tuple[AttentionFacts, ...], mesh: DeviceMesh) -> list[str]:
    """Split every attention's projection norms over `mesh` (the tp mesh); returns their names."""
    split = []
    for facts in attention:
        for name in facts.projection_norms:
            path = f"{facts.path}.{name}"
            try:
                norm = model.get_submodule(path)
            except AttributeError:  # on another pipeline stage
                continue
            # (torch's stub types input_fn as returning None; distribute_module uses what it returns)
            distribute_module(norm, mesh, _split_weight, _inputs_as_parts, _local_output)  # type: ignore[arg-type]
            split.append(path)
    return split
