"""How a batch becomes a loss in `engine.train_step`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.core.errors import MeshkitError

LossFn = Callable[[Any, Any], torch.Tensor]


class LossError(MeshkitError):
    """A batch or model output the engine cannot turn into a loss; the message says what to pass."""


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """`loss_fn(model(inputs), targets)` for (inputs, targets) batches; otherwise the model's own loss.

    Without `loss_fn` the batch is spread into the call (`model(**batch)` for a mapping, `model(*batch)` for
    a tuple) and the output must be a scalar tensor or carry one as `.loss` / `["loss"]` (HF style).
    """
    if loss_fn is not None:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise LossError("with loss_fn, each batch must be an (inputs, targets) pair")
        inputs, targets = batch
        output = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
        return loss_fn(output, targets)
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    loss: Any
    if isinstance(output, torch.Tensor):
        loss = output
    else:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f" (a tensor of shape {list(loss.shape)})" if isinstance(loss, torch.Tensor) else ""
        raise LossError(f"the model's output carries no scalar loss{shape}: pass loss_fn= to engine.prepare()")
    return loss


IGNORE_INDEX = -100  # label of a token that does not count (padding, prompt), as in transformers


def is_causal_lm_batch(batch: Any) -> bool:
    """A transformers-style batch: a mapping with `input_ids` and `labels`."""
    return isinstance(batch, Mapping) and "input_ids" in batch and "labels" in batch


def split_causal_lm_batch(batch: Mapping[str, Any], shift: int = 1) -> tuple[dict[str, Any], torch.Tensor]:
    """(model inputs, next-token targets) of an HF-style batch. The labels are shifted here, once, so that a
    sequence split afterwards (context parallel) keeps each token's target; the last position gets none.
    `shift` 0: the model takes its labels already shifted (`models/own_loss.py`), they are the targets as given.

    An `attention_mask` is checked to pad on the right only (every row ones, then zeros) and dropped: causal
    attention never looks at later (pad) positions, and pads carry label -100.
    """
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    labels = batch["labels"]
    mask = inputs.pop("attention_mask", None)
    if mask is not None:
        mask = mask.to(torch.int64)
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise LossError(
                "attention_mask has a pad before a real token: pad on the right (and label pads -100), or pass "
                "loss_fn= to handle the batch yourself"
            )
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    if shift == 0:
        return inputs, labels
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-shift] = labels[:, shift:]
    return inputs, targets


def shifted_for_split(batch: Mapping[str, Any], parts: int, shift: int = 1) -> dict[str, Any]:
    """An HF-style batch a model's own loss still reads after a sequence split into `parts` (context parallel):
    the labels shifted on the whole sequence (`shift_labels`, which transformers' loss takes as they are), and
    `num_items_in_batch` = the whole sequence's target count / `parts`, so each part's loss is its share of
    the whole's mean times `parts`: averaged over the parts (as their gradients are), the whole's mean."""
    inputs, targets = split_causal_lm_batch(batch, shift)
    count = (targets != IGNORE_INDEX).sum().clamp(min=1).float()
    return {**inputs, "labels": batch["labels"], "shift_labels": targets, "num_items_in_batch": count / parts}


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, `.logits` or `["logits"]`."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise LossError("the model returned no logits for the causal-LM loss: pass loss_fn= to engine.prepare()")
    return logits


TokenWeights = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits [n, vocab], targets [n]) -> [n]


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, weights: TokenWeights | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) over the targets that count — each token's times its weight when
    `weights` gives them (computed without gradient; `meshkit.training.token_weights`). logits: [batch, seq, vocab],
    vocab-sharded under loss parallel."""
    flat, flat_targets = logits.flatten(0, 1).float(), targets.flatten()
    if weights is None:
        return F.cross_entropy(flat, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    per_token = F.cross_entropy(flat, flat_targets, ignore_index=IGNORE_INDEX, reduction="none")
    with torch.no_grad():
        weight = weights(flat.detach(), flat_targets) * (flat_targets != IGNORE_INDEX)
    if isinstance(per_token, DTensor):  # (loss parallel: every rank holds every token's loss)
        weight = DTensor.from_local(weight, per_token.device_mesh, per_token.placements)
    return (per_token * weight).sum()


class CausalLMLoss:
    """The default pipeline loss for causal LMs: each micro-batch's summed token loss, scaled so that the
    step's gradient is the mean over every counted token of the step on every data-parallel rank.

    `scale` is set before each step (micro-batches × data-parallel ranks / tokens counted in the step).
    """

    def __init__(self) -> None:
        self.scale = 1.0
        self.weights: TokenWeights | None = None  # (`Engine.weigh_token_losses`)
        self.fused: Any = None  # the last stage's FusedHead (`meshkit.training.fused_head`): losses without logits

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        total = self.fused.take_loss(logits_of(output)) if self.fused is not None else None
        if total is None:
            total = token_loss_sum(logits_of(output), targets, self.weights)
        return total * self.scale


STAGE_KEYWORDS = ("position_ids",)  # batch entries every pipeline stage takes besides its input


def pipeline_pair(batch: Any, causal: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(inputs, targets, keyword inputs) for a pipeline schedule: the first stage takes one tensor, the last the
    targets, and every stage the keyword inputs (`position_ids`: packed samples' positions, which each stage's
    attention masks and rotary tables need)."""
    if causal:
        inputs, targets = batch
        extra = sorted(set(inputs) - {"input_ids", *STAGE_KEYWORDS})
        if extra:
            raise LossError(
                f"under pipeline parallel a stage takes only input_ids and {', '.join(STAGE_KEYWORDS)}: drop {extra} "
                "from the batch"
            )
        keywords = {key: inputs[key] for key in STAGE_KEYWORDS if inputs.get(key) is not None}
        return inputs["input_ids"], targets, keywords
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise LossError("under pipeline parallel each batch must be an (inputs, targets) pair or an HF dict batch")
    return batch[0], batch[1], {}
