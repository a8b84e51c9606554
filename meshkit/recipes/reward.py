"""Reward models in the fine-tune recipe (`reward_model: true`): a sequence-classification head with one output
scores each row at its last token that is not padding (transformers' own pooling); the Bradley–Terry loss (TRL's
RewardTrainer) pushes the chosen reply's score above the rejected one's. The exported `merged/` loads with
`AutoModelForSequenceClassification.from_pretrained` and scores as in training."""

from __future__ import annotations

from typing import Any

import torch

from meshkit.core.errors import MeshkitError
from meshkit.training.objective import ObjectiveResult, Scorer, SequenceScores
from meshkit.training.preference import BradleyTerry


class RewardObjective:
    """Chosen and rejected rows of each pair in one forward; the loss over the pairs (evaluation's filler pairs
    left out)."""

    needs_whole = False
    needs_weighting = False
    pairs_together = True

    def __init__(self, loss: BradleyTerry) -> None:
        self.loss = loss

    def __call__(self, score: Scorer, batch: dict[str, torch.Tensor]) -> ObjectiveResult:
        logits = score.outputs({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
        rewards = logits.squeeze(-1).float()  # [rows]
        chosen, rejected = rewards.chunk(2)
        if "valid" in batch:
            keep = batch["valid"].to(rewards.device)
            chosen, rejected = chosen[keep], rejected[keep]
        return self.loss(chosen, rejected)

    def references(self, score: Scorer, batch: Any) -> dict[str, torch.Tensor]:
        raise MeshkitError("a reward model's scores come from its whole outputs: pipeline parallel does not run it")

    def loss_of(self, policy_rows: SequenceScores, extras: dict[str, torch.Tensor]) -> ObjectiveResult:
        raise MeshkitError("a reward model's scores come from its whole outputs: pipeline parallel does not run it")
