"""When a fine-tune stops early: the loss watchdog (Axolotl's `loss_watchdog_threshold`/`_patience`: a loss that
stays above the threshold means a diverged run, stopped with one line) and early stopping on the eval loss
(`early_stopping_patience` evaluations without a new best). Both decide on values every rank holds alike."""

from __future__ import annotations

import math

from meshkit.core.errors import MeshkitError


class LossWatchdogError(MeshkitError):
    """The training loss stayed above `loss_watchdog_threshold`; the message names the steps."""


class LossWatchdog:
    def __init__(self, threshold: float | None, patience: int) -> None:
        self.threshold, self.patience = threshold, patience
        self.above = 0

    def check(self, step: int, loss: float) -> None:
        if self.threshold is None:
            return
        self.above = self.above + 1 if (loss > self.threshold or math.isnan(loss)) else 0
        if self.above >= self.patience:
            raise LossWatchdogError(
                f"the loss stayed above loss_watchdog_threshold={self.threshold} for {self.above} steps (step {step}: "
                f"{loss:.4f}): the run diverged; lower learning_rate or raise the threshold"
            )


class EarlyStopping:
    """True from `should_stop` once `patience` evaluations in a row brought no better eval loss."""

    def __init__(self, patience: int | None) -> None:
        self.patience = patience
        self.best = math.inf
        self.without_improvement = 0

    def should_stop(self, eval_loss: float) -> bool:
        if self.patience is None:
            return False
        if eval_loss < self.best:
            self.best, self.without_improvement = eval_loss, 0
        else:
            self.without_improvement += 1
        return self.without_improvement >= self.patience
