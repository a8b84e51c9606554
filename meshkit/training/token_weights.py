"""Per-token loss weights for the causal-LM loss (`Engine.weigh_token_losses`).

EAFT — entropy-aware focal training (Axolotl's `use_eaft`, `eaft_alpha`, `eaft_k`): each token's cross-entropy
is weighted by the entropy of the model's distribution over its `k` most likely next tokens, to the power `alpha`
(no gradient through the weight): confident predictions weigh little, uncertain ones much. Under tensor parallel
each rank holds a slice of the vocabulary: its own top `k` are gathered over tp and the top `k` of those taken —
exactly the top `k` of the whole vocabulary.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch.distributed.tensor import DTensor

from meshkit.config.section import Section
from meshkit.training.loss import TokenWeights


class EaftSettings(Section):
    """EAFT's keys (Axolotl's names)."""

    use_eaft: bool = Field(False, description="EAFT: each token's loss weighted by its top-k entropy ** alpha")
    eaft_alpha: float = Field(1.0, ge=0, description="EAFT: the entropy's exponent")
    eaft_k: int = Field(20, ge=1, description="EAFT: the top logits the entropy is taken over")


def top_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` largest logits of each row ([n, vocab] -> [n, k]), of the whole vocabulary even when `logits` is
    a vocab-sharded DTensor (every rank gets them)."""
    if not isinstance(logits, DTensor):
        return logits.topk(min(k, logits.shape[-1]), dim=-1).values
    local = logits.to_local()
    own = local.topk(min(k, local.shape[-1]), dim=-1).values.contiguous()
    gathered = DTensor.from_local(own, logits.device_mesh, logits.placements).full_tensor()
    return gathered.topk(min(k, gathered.shape[-1]), dim=-1).values


def entropy_weights(alpha: float = 1.0, k: int = 20) -> TokenWeights:
    """EAFT's weights: (entropy of the softmax over each row's top-`k` logits) ** `alpha`."""

    def weights(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(top_logits(logits, k).float(), dim=-1)
        entropy = -(probabilities * torch.log(probabilities + 1e-10)).sum(dim=-1)
        return entropy.pow(alpha)

    return weights
