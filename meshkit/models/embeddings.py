"""Which module turns a model's token ids into its hidden states."""

from __future__ import annotations

from torch import nn


def input_embedding(model: nn.Module) -> nn.Module | None:
    """transformers' `get_input_embeddings()`, else the model's first `nn.Embedding` (the reference GPT's
    `tok_embeddings`); None where there is none, or a pipeline stage holds a stand-in for it."""
    getter = getattr(model, "get_input_embeddings", None)
    found = getter() if callable(getter) else None
    if not isinstance(found, nn.Module):
        found = next((module for module in model.modules() if isinstance(module, nn.Embedding)), None)
    if found is None or getattr(found, "is_placeholder", False):
        return None
    return found
