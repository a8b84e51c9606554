"""This rank's part of a tensor that may be a DTensor (tensor parallel, ZeRO-3, context parallel)."""

from __future__ import annotations

import torch


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (`to_local`: a view autograd follows); any other tensor itself."""
    from torch.distributed.tensor import DTensor  # (here: the launcher reads resident memory, needs no DTensor)

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
