"""Process reward models in the fine-tune recipe (`process_reward_model: true`, Axolotl's key; TRL's PRM): a token
classification head (two labels: the step is wrong / right) judges each reasoning step at its last token
(`meshkit.data.stepwise`). The loss is the cross-entropy over every labelled token of the step's micro-batches on
every rank — the mean transformers' token-classification loss takes over one batch, over the whole step here — and
`accuracy` is the share of steps judged right. The exported `merged/` loads with
`AutoModelForTokenClassification.from_pretrained` and scores as in training."""

from __future__ import annotations

from typing import Any

import torch

from meshkit.core.errors import MeshkitError
from meshkit.training.objective import ObjectiveResult, Scorer, SequenceScores

IGNORE_INDEX = -100


class StepObjective:
    """Each row's labelled tokens through the head; evaluation's filler rows (`valid: false`) left out."""

    needs_whole = False
    needs_weighting = False
    pairs_together = False
    uses_reference = False

    def __call__(self, score: Scorer, batch: dict[str, torch.Tensor]) -> ObjectiveResult:
        logits = score.outputs({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
        labels = batch["labels"].to(logits.device)
        if "valid" in batch:
            labels = labels.masked_fill(~batch["valid"].to(logits.device)[:, None], IGNORE_INDEX)
        counted = labels != IGNORE_INDEX
        steps = int(counted.sum())
        flat = logits.float().reshape(-1, logits.shape[-1])
        total = torch.nn.functional.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = total / max(steps, 1)
        right = (logits.argmax(dim=-1) == labels) & counted
        count = torch.tensor(float(steps), device=logits.device)
        return ObjectiveResult(loss, steps, {"accuracy": (right.sum().float().detach(), count)})

    def references(self, score: Scorer, batch: Any) -> dict[str, torch.Tensor]:
        raise MeshkitError("a process reward model reads its whole outputs: pipeline parallel does not run it")

    def loss_of(self, policy_rows: SequenceScores, extras: dict[str, torch.Tensor]) -> ObjectiveResult:
        raise MeshkitError("a process reward model reads its whole outputs: pipeline parallel does not run it")
