"""How a causal LM's own loss reads its labels, learnt from one forward: meshkit computes the next-token loss
from the logits itself (so that a sequence split, a pipeline's last stage or vocab-sharded logits get it right),
and that must equal what `model(**batch).loss` gives as written.

transformers' causal LMs shift the labels inside (`labels[:, 1:]` are the targets of `logits[:, :-1]`), but not
every one does: CpmAnt takes its labels already shifted, and a model may add terms of its own. One forward of two
sample rows with `labels = input_ids` tells which: the model's loss equals the cross-entropy of its logits against
the labels shifted by one (1), unshifted (0), or neither (None: the loss is the model's own; meshkit keeps it
where the layout lets the model compute it whole).

Whether the logits are the head's output as it is (so that the loss can be computed without them) is learnt from
how they are made, on real weights or the meta device alike: `models/logits_head.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshkit.models.facts import ModelStructure, has_meta_tensors, takes_argument, takes_cache_switch
from meshkit.models.hf_adapter import is_transformers_model

TOLERANCE = 1e-4  # relative: the same logits give the same cross-entropy up to summation order


@dataclass(frozen=True)
class OwnLoss:
    """The model's own loss against the next-token cross-entropy of its logits."""

    shift: int | None  # labels[:, shift:] are the targets of logits[:, :len - shift]; None: neither 1 nor 0 fits
    own: float  # the model's loss on the sample
    next_token: float  # the cross-entropy of its logits against the labels shifted by one


def own_loss(model: nn.Module, structure: ModelStructure) -> OwnLoss | None:
    """How `model`'s own loss reads its labels; None where nothing can be learnt (not a transformers causal LM,
    weights on the meta device, a forward that does not run on sample tokens or returns no loss)."""
    if not (structure.causal_lm and is_transformers_model(model)) or has_meta_tensors(model):
        return None
    vocab = _vocabulary(model)
    if vocab < 2:
        return None
    param = next(model.parameters())
    generator = torch.Generator().manual_seed(0)
    low = 3 if vocab > 8 else 0  # (clear of the usual pad / bos / eos ids)
    ids = torch.randint(low, vocab, (2, 8), generator=generator).to(param.device)
    try:
        output = _forward(model, ids)
    except Exception:  # noqa: BLE001 - a forward that does not run on sample tokens: nothing learnt
        return None
    loss, logits = getattr(output, "loss", None), getattr(output, "logits", None)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and isinstance(logits, torch.Tensor)):
        return None
    if logits.dim() != 3 or logits.shape[:2] != ids.shape:
        return None
    own = float(loss)
    scores = {shift: _cross_entropy(logits, ids, shift) for shift in (1, 0)}
    fits = [shift for shift, value in scores.items() if abs(value - own) <= TOLERANCE * max(abs(own), 1e-6)]
    return OwnLoss(fits[0] if fits else None, own, scores[1])


def _forward(model: nn.Module, ids: torch.Tensor) -> Any:
    """The model on `ids` with `labels=ids`, without cache or router terms, in its own mode (the loss and the
    logits come from the same forward, dropout or not; a switch of mode may have side effects: RWKV rescales)."""
    kwargs: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if takes_cache_switch(model):
        kwargs["use_cache"] = False
    if takes_argument(model.forward, "output_router_logits"):  # (a balancing term in the loss is meshkit's to add)
        kwargs["output_router_logits"] = False
    with torch.no_grad():
        return model(**kwargs)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, shift: int) -> float:
    width = logits.shape[1] - shift
    flat = logits[:, :width].reshape(-1, logits.shape[-1]).float()
    return float(F.cross_entropy(flat, labels[:, shift:].reshape(-1)))


def _vocabulary(model: nn.Module) -> int:
    """Token ids both the input embedding and the head know (CpmAnt's embedding has prompt rows besides)."""
    sizes = [
        size
        for getter, attribute in (("get_input_embeddings", "num_embeddings"), ("get_output_embeddings", "out_features"))
        if callable(getattr(model, getter, None))
        and isinstance(size := getattr(getattr(model, getter)(), attribute, None), int)
    ]
    return min(sizes, default=0)
