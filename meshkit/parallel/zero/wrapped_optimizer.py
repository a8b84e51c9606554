"""The base of optimizers that wrap another: the wrapped one keeps the param groups (an LR scheduler drives them),
the state and the defaults; the wrapper changes only how a step runs."""

from __future__ import annotations

from typing import Any

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """Param groups, state and defaults are `self.optimizer`'s (deliberately no `super().__init__`)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults
