"""The base of optimizers that wrap another: the wrapped one keeps the param groups (an LR scheduler drives them),
the state and the defaults; the wrapper changes only how a step runs (accumulation, ZeRO's chunks, offload)."""

from __future__ import annotations

from typing import Any

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """Param groups, state and defaults are `wrapped()`'s, `self.optimizer` unless a subclass names another
    (deliberately no `super().__init__`: this object is a view that keeps no state of its own; setting one of
    the three sets the wrapped optimizer's)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def wrapped(self) -> torch.optim.Optimizer:
        return self.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.wrapped().param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.wrapped().param_groups = groups

    @property
    def state(self) -> Any:
        return self.wrapped().state

    @state.setter
    def state(self, state: Any) -> None:
        self.wrapped().state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.wrapped().defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.wrapped().defaults = defaults
