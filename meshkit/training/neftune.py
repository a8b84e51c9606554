"""NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"), as transformers' Trainer
defines it (`neftune_noise_alpha`): while the model trains, the input embeddings' output gets uniform noise in
±alpha / sqrt(sequence length × hidden size); in evaluation (`model.eval()`) nothing.

The sequence length is the whole row's: the token ids' length (sequence parallel may shard the output already),
times the ranks a context-parallel row is split over, so the noise has the size one process would give it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from meshkit.runtime.dtensors import local_tensor


def add_embedding_noise(embedding: nn.Module, alpha: float, sequence_parts: int = 1) -> RemovableHandle:
    """Noise on `embedding`'s output [batch, seq, hidden] in training; `sequence_parts`: ranks each row's token
    ids are split over (context parallel). Returns the hook's handle (`.remove()` ends it)."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if not module.training or not isinstance(output, torch.Tensor) or output.dim() != 3:
            return None
        local = local_tensor(output)
        ids = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 2 else None
        length = (ids.shape[1] if ids is not None else local.shape[1]) * sequence_parts
        bound = alpha / math.sqrt(length * local.shape[2])
        noise = torch.zeros_like(local).uniform_(-bound, bound)
        if isinstance(output, DTensor):
            noise = DTensor.from_local(noise, output.device_mesh, output.placements, run_check=False)
        return output + noise

    return embedding.register_forward_hook(hook)
