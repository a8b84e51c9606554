"""An objective over whole sequences: what `Engine.objective_step` runs instead of the token loss.

An objective reads the model through a `Scorer` — per sequence, the summed log-probability of its completion
tokens (labels other than -100) and their count, or (a `HeadObjective`, reward models) row sums of terms of a
classification head's outputs, computed in the run's layout — and returns an `ObjectiveResult`:
the mean loss over this rank's examples, their count (gradients average over every rank's examples) and metric
sums with their counts (a step's metric is the sum over ranks and micro-steps divided by the summed count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class SequenceScores:
    """Per sequence: the summed log-probability of its completion tokens ([rows]) and their count ([rows])."""

    logps: torch.Tensor
    tokens: torch.Tensor
    whole_logps: torch.Tensor | None = None  # over every real token, prompt included (when asked: `whole_mask`)
    whole_tokens: torch.Tensor | None = None
    # WPO's per-row weight in log space (when asked: `weighting`): the completion tokens' mean of
    # log p(token) − log Σ_v p(v)², without a graph
    log_weights: torch.Tensor | None = None


@dataclass
class ObjectiveResult:
    loss: torch.Tensor
    items: int
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class Scorer(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        model: nn.Module | None = None,
        context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        grad: bool = True,
        whole_mask: torch.Tensor | None = None,
        weighting: bool = False,
    ) -> SequenceScores:
        """`model`: another prepared module laid out like the policy (a frozen reference); `context`: entered
        around the forward (e.g. adapters off); `grad=False` scores without a graph; `whole_mask` (the attention
        mask): also score every real token, prompt included; `weighting`: also WPO's `log_weights`."""
        ...

    def head_sums(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        terms: int,
        grad: bool = True,
    ) -> torch.Tensor:
        """[terms, rows]: per row, the sum over its tokens of `values(outputs, targets)` ([terms, rows, seq]), where
        `outputs` are the prepared model's classification head's per-token outputs (before any pooling) and
        `targets` the per-token targets given ([rows, seq])."""
        ...


class Objective(Protocol):
    """`__call__` runs the whole objective through a scorer; a pipeline runs it in two phases instead:
    `references` (per-row tensors scored without a graph, `valid` among them) before the schedule, and `loss_of`
    on the last stage for each micro-batch's rows."""

    reads_head: bool  # a `HeadObjective`: reads a classification head's outputs, not log-probabilities
    needs_whole: bool  # the policy's scores of every real token too (ORPO's NLL)
    needs_weighting: bool  # the policy's WPO weights too (`SequenceScores.log_weights`)
    pairs_together: bool  # rows are [chosen..., rejected...]: a micro-batch must hold both rows of its pairs

    def __call__(self, score: Scorer, batch: Any) -> ObjectiveResult: ...

    def references(self, score: Scorer, batch: Any) -> dict[str, torch.Tensor]: ...

    def loss_of(self, policy_rows: SequenceScores, extras: dict[str, torch.Tensor]) -> ObjectiveResult: ...


class HeadObjective(Protocol):
    """An objective over a classification head's per-token outputs (reward models): `token_values` of the outputs
    and each row's `head_targets`, summed over every row's tokens, make `loss_of_sums`'s input. `references` gives
    per-row extras (`valid`: an evaluation batch's filler rows count nothing); `count` the examples a batch's
    gradient averages over. A pipeline runs `loss_of_sums` on its last stage for each micro-batch's rows."""

    reads_head: bool  # True
    pairs_together: bool
    terms: int  # the rows of `token_values`

    def __call__(self, score: Scorer, batch: Any) -> ObjectiveResult: ...

    def references(self, score: Scorer, batch: Any) -> dict[str, torch.Tensor]: ...

    def head_targets(self, batch: Any) -> torch.Tensor: ...

    def token_values(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def count(self, targets: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def loss_of_sums(self, sums: torch.Tensor, extras: dict[str, torch.Tensor]) -> ObjectiveResult: ...
