"""Process reward models in the fine-tune recipe (`process_reward_model: true`, Axolotl's key; TRL's PRM): a token
classification head (two labels: the step is wrong / right) judges each reasoning step at its last token
(`meshkit.data.stepwise`). The loss is the cross-entropy over every labelled token of the step's micro-batches on
every rank — the mean transformers' token-classification loss takes over one batch, over the whole step here — and
`accuracy` is the share of steps judged right. The exported `merged/` loads with
`AutoModelForTokenClassification.from_pretrained` and scores as in training. Per-token terms summed per row
(`Scorer.head_sums`), so every layout runs it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from meshkit.training.objective import ObjectiveResult, Scorer

IGNORE_INDEX = -100


class StepObjective:
    """Each row's labelled tokens through the head; evaluation's filler rows (`valid: false`) left out."""

    reads_head = True
    needs_whole = False
    needs_weighting = False
    pairs_together = False
    uses_reference = False
    terms = 3  # cross-entropy, steps judged right, steps

    def head_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        if "valid" in batch:
            labels = labels.masked_fill(~batch["valid"].to(labels.device)[:, None], IGNORE_INDEX)
        return labels

    def token_values(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = targets.shape[0]
        flat = outputs.float().reshape(-1, outputs.shape[-1])
        entropy = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
        counted = targets != IGNORE_INDEX
        right = ((outputs.detach().argmax(dim=-1) == targets) & counted).float()
        return torch.stack((entropy.view(rows, -1), right, counted.float()))

    def references(self, score: Scorer, batch: Any) -> dict[str, torch.Tensor]:
        return {}  # (filler rows are left out by their targets)

    def count(self, targets: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return (targets != IGNORE_INDEX).sum()

    def loss_of_sums(self, sums: torch.Tensor, extras: dict[str, torch.Tensor]) -> ObjectiveResult:
        total, right, steps = sums.sum(-1)
        loss = total / steps.clamp(min=1)
        return ObjectiveResult(loss, int(steps), {"accuracy": (right.detach(), steps.detach())})

    def __call__(self, score: Scorer, batch: Any) -> ObjectiveResult:
        sums = score.head_sums(batch["input_ids"], self.head_targets(batch), self.token_values, self.terms)
        return self.loss_of_sums(sums, {})
