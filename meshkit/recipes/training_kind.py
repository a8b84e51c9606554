"""What differs between the fine-tune's kinds of training — supervised fine-tuning, the DPO family, KTO, reward and
process-reward models: the data (its dataset kind, loader and validation) and the objective (the micro-step, the
step loss, the evaluation), with the summary rows and the table each reports.

`meshkit.recipes.finetune` sets up and runs every kind the same way (base model, adapters, optimizer, schedule,
`engine.prepare`, the shared loop, outputs); a kind answers only the questions below. The config chooses the kind
(`finetune.training_kind`): `rl:` a preference method, `reward_model: true`, `process_reward_model: true`, else
supervised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from meshkit.engine.engine import Engine
from meshkit.recipes.finetune_setup import FinetuneModel
from meshkit.recipes.loop import LoopRecord, StepLoss


class TrainingKind(Protocol):
    """One kind of fine-tune. Called in this order: `load_data`, `before_prepare`, (the Engine prepares),
    `after_prepare`, `banner`, `step_loss` / `micro_step` / `evaluation`, (the loop runs), `summary_rows`,
    `plot_curves`, `table_rows`."""

    name: str  # the summary's `objective` and the record of what ran: sft, dpo, kto, reward_model, ...

    def load_data(self, engine: Engine, tokenizer: Any) -> None:
        """Tokenize the datasets and build this rank's loader (before the model is adapted)."""
        ...

    @property
    def rows(self) -> int:
        """Training rows (samples, packed rows, pairs or records): an epoch's length for the step plan."""
        ...

    @property
    def loader(self) -> Any: ...

    @property
    def tokens_per_row(self) -> float: ...

    def token_ids(self) -> Iterable[Sequence[int]]:
        """The token ids of every training row (`fix_untrained_tokens` counts which tokens the data uses)."""
        ...

    def before_prepare(self, engine: Engine, built: FinetuneModel) -> None:
        """What must happen to the model before `engine.prepare` (a preference run's frozen reference copy)."""
        ...

    def after_prepare(self, engine: Engine, model: nn.Module, built: FinetuneModel) -> None:
        """What needs the prepared model (EAFT's token weights; the reference, scored or switched)."""
        ...

    def banner(self, engine: Engine) -> tuple[str, str, list[str]]:
        """(what the start line calls the training, the data and steps words' data part, further notice lines)."""
        ...

    def objective_words(self) -> str:
        """The record of what ran's `objective` line after the name: the loss and where its reference comes from."""
        ...

    def step_loss(self, engine: Engine) -> StepLoss: ...

    def micro_step(self) -> Callable[[Any], torch.Tensor] | None:
        """The micro-step when it is not `engine.train_step` (the causal-LM loss)."""
        ...

    def evaluation(self, engine: Engine, model: nn.Module) -> Callable[[], dict[str, float]] | None: ...

    def summary_rows(self, engine: Engine, record: LoopRecord, outputs: dict[str, str]) -> dict[str, Any]:
        """The kind's own summary rows (every rank calls it: rows may gather)."""
        ...

    def plot_curves(
        self, record: LoopRecord
    ) -> tuple[list[tuple[float, float]], dict[str, list[tuple[float, float]]] | None]:
        """(the evaluation curve drawn over the losses, further curves by name) for loss.png."""
        ...

    def table_rows(self, summary: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
        """(the final table's title, its kind-specific rows)."""
        ...
