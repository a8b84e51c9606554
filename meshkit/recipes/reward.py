"""Reward models in the fine-tune recipe (`reward_model: true`): a sequence-classification head with one output
scores each row at its last token that is not padding (transformers' own pooling); the Bradley–Terry loss (TRL's
RewardTrainer) pushes the chosen reply's score above the rejected one's. The exported `merged/` loads with
`AutoModelForSequenceClassification.from_pretrained` and scores as in training.

The head's per-token scores are read whole (`Scorer.head_sums`) and pooled here, at the position transformers
pools at, so the same objective runs in every layout: the pooled token may lie in any context-parallel chunk, on
the last pipeline stage."""

from __future__ import annotations

from typing import Any

import torch

from meshkit.training.objective import ObjectiveResult, Scorer
from meshkit.training.preference import BradleyTerry


def last_real_positions(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Per row, the position transformers' sequence classification pools at: the last token that is not padding
    (the row's last token where no pad token is known)."""
    if pad_token_id is None:
        return torch.full(input_ids.shape[:1], input_ids.shape[1] - 1, dtype=torch.long, device=input_ids.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


class RewardObjective:
    """Chosen and rejected rows of each pair in one forward; the loss over the pairs (evaluation's filler pairs
    left out)."""

    reads_head = True
    needs_whole = False
    needs_weighting = False
    pairs_together = True
    terms = 1

    def __init__(self, loss: BradleyTerry, pad_token_id: int | None) -> None:
        self.loss, self.pad_token_id = loss, pad_token_id

    def head_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """1 at each row's pooled position, 0 elsewhere."""
        input_ids = batch["input_ids"]
        targets = torch.zeros_like(input_ids)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        targets[rows, last_real_positions(input_ids, self.pad_token_id)] = 1
        return targets

    def token_values(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (outputs[..., 0].float() * (targets == 1)).unsqueeze(0)  # the score at the pooled position

    def references(self, score: Scorer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pairs = batch["input_ids"].shape[0] // 2
        valid = batch["valid"] if "valid" in batch else torch.ones(pairs, dtype=torch.bool)
        return {"valid": valid.repeat(2)}

    def count(self, targets: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return extras["valid"].sum() // 2  # pairs

    def loss_of_sums(self, sums: torch.Tensor, extras: dict[str, torch.Tensor]) -> ObjectiveResult:
        chosen, rejected = sums[0].chunk(2)
        keep = extras["valid"].to(sums.device).chunk(2)[0]
        return self.loss(chosen[keep], rejected[keep])

    def __call__(self, score: Scorer, batch: Any) -> ObjectiveResult:
        sums = score.head_sums(batch["input_ids"], self.head_targets(batch), self.token_values, self.terms)
        return self.loss_of_sums(sums, self.references(score, batch))
