"""Which trainable parameters a training forward leaves without a gradient (an indexer that only picks top-k
positions, a multi-token-prediction head the loss never reads): DDP must look for unused parameters on such a
model, or its reducer stops at the first step. Learnt from one forward of a few tokens: the parameters its output's
autograd graph reaches (no backward runs, no gradient is stored)."""

from __future__ import annotations

import torch
from torch import nn

from meshkit.models.facts import ModelStructure
from meshkit.models.forward_trace import first_tensor, walk
from meshkit.models.hf_adapter import is_transformers_model
from meshkit.models.layer_roles import sample_forward


def parameters_without_gradient(model: nn.Module, structure: ModelStructure) -> tuple[str, ...]:
    """Names of `model`'s trainable parameters its output does not depend on; () when the model is not a
    transformers model or the forward on sample tokens fails (nothing learnt, nothing claimed)."""
    if not is_transformers_model(model):
        return ()
    try:
        with torch.enable_grad():
            output = sample_forward(model, structure)()
        logits = getattr(output, "logits", None)
        logits = logits if isinstance(logits, torch.Tensor) else first_tensor(output)
    except Exception:  # noqa: BLE001 - a forward that does not run on sample tokens: nothing learnt
        return ()
    if logits is None or logits.grad_fn is None:
        return ()
    reached = {id(node.variable) for node in walk(logits.grad_fn, lambda _: False) if hasattr(node, "variable")}
    return tuple(name for name, param in model.named_parameters() if param.requires_grad and id(param) not in reached)
