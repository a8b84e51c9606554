"""Which attention computation a model runs: what a summary names and what the memory estimate follows.

transformers models say it in their config (`_attn_implementation`: `eager`, `sdpa`, `flash_attention_2`, ...,
or the name ring attention registers); the reference GPT calls torch's scaled_dot_product_attention; of any
other model nothing is known.
"""

from __future__ import annotations

from torch import nn

from meshkit.models.gpt import GPT
from meshkit.models.hf_adapter import is_transformers_model, text_config

# implementations that never keep the [heads, seq, seq] scores for backward (fused kernels); `eager` keeps them,
# and SDPA's math fallback does too (it is chosen only where no fused kernel takes the inputs)
FUSED_KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "paged_attention")


def attention_implementation(model: nn.Module) -> str | None:
    """The model's attention implementation by its transformers name; None where the model does not say.

    The first model that says, from the outside in: a wrapper (peft's, a compiled module) holds the model.
    """
    for module in model.modules():
        if isinstance(module, GPT):
            return "sdpa"
        if is_transformers_model(module):
            config = getattr(module, "config", None)
            found = getattr(text_config(config), "_attn_implementation", None) if config is not None else None
            return str(found) if found else None
    return None


def stores_scores(implementation: str | None) -> bool:
    """Whether backward keeps each attention's [heads, seq, seq] scores (eager, or an implementation not known)."""
    return implementation is None or not any(implementation.startswith(kind) for kind in FUSED_KERNELS)
