"""The fine-tune's validation batches, its evaluation and its per-step loss, in any layout."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from meshkit.core.tree import to_device
from meshkit.data.formats import TokenizedSample
from meshkit.data.packing import PaddedSamples
from meshkit.engine.engine import Engine
from meshkit.runtime import collectives
from meshkit.training.loss import IGNORE_INDEX


def eval_batches(
    samples: Sequence[TokenizedSample], engine: Engine, collate: Any, size: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """This rank's validation batches: every sample exactly once over the data-parallel ranks; ranks with fewer
    samples fill up with rows whose labels are all -100 (they count nothing), so every rank runs as many
    batches of the same size (pipelines and sharded parameters need all ranks in each forward)."""
    if not samples:
        return []
    size, dp = size or engine.config.train.largest_micro_batch, engine.dp_size
    per_rank = -(-len(samples) // dp)
    batches = -(-per_rank // size)
    mine = list(samples[engine.dp_rank :: dp])
    filler = TokenizedSample(samples[0].input_ids, (IGNORE_INDEX,) * len(samples[0].labels))
    mine = mine + [filler] * (batches * size - len(mine))
    dataset = PaddedSamples(mine)
    return [collate([dataset[i] for i in range(b * size, (b + 1) * size)]) for b in range(batches)]


def evaluate(engine: Engine, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    total, count = 0.0, 0
    model.eval()
    for batch in batches:
        loss_sum, tokens = engine.eval_token_loss(to_device(batch, engine.device))
        total, count = total + loss_sum, count + tokens
    model.train()
    loss = total / max(count, 1)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": count}


class WindowLoss:
    """The loss of an optimizer step: the mean over every counted token of its micro-steps on every
    data-parallel rank (each micro-step's loss, from `train_step`, is its own token mean)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.losses: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        self.losses.append(loss.detach().float())
        self.tokens.append((batch["labels"][:, 1:] != IGNORE_INDEX).sum().float())  # next-token targets

    def mean(self) -> float:
        # every cp rank holds the whole batch: count over the data-parallel ranks only
        tokens = collectives.reduce(torch.stack(self.tokens), self.engine.mesh.dp_group, op="sum")
        loss = float((torch.stack(self.losses) * tokens).sum() / tokens.sum().clamp(min=1))
        self.losses, self.tokens = [], []
        return loss

    def metrics(self) -> dict[str, float]:
        return {}
