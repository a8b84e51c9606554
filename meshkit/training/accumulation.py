"""Gradient accumulation: when gradients synchronise, and optimizer/scheduler wrappers that honour it.

The engine owns one `GradientState` per run. Inside `engine.accumulate()` it counts micro-steps; only the
last micro-step of a window (or the last batch of the data) synchronises gradients, and only then do the
prepared optimizer and scheduler step. fp16 steps skipped by the loss scaler do not advance the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshkit.training.wrapped_optimizer import WrappedOptimizer


@dataclass
class GradientState:
    """Mutable per-run accumulation state (one instance per Engine, never shared between runs)."""

    accum_steps: int
    micro_step: int = 0
    sync: bool = True
    end_of_dataloader: bool = False
    window_items: float = 0.0  # items (e.g. tokens) seen in this window, for item-weighted averaging
    window_global_items: float | None = 0.0  # the window's items on every rank, when each micro-step told them
    weighted_window: bool | None = None  # does this window weight the loss by items? (fixed at first backward)
    optimizer_stepped: bool = False  # did the last optimizer step really update (False after an fp16 skip)?
    active_loader: Any = None  # the prepared loader being iterated (gather_for_metrics trims its padding)
    last_window_items: float = 0.0  # items the last finished window weighted its loss by (0: unweighted)

    sync_with_dataloader: bool = True  # the last batch of the data ends a window (False: windows span epochs)

    def begin_micro_step(self) -> None:
        self.micro_step += 1
        at_end = self.end_of_dataloader and self.sync_with_dataloader
        self.sync = self.micro_step % self.accum_steps == 0 or at_end
        if at_end:  # the next window starts with the next epoch
            self.micro_step = 0

    def end_window(self) -> None:
        self.last_window_items = self.window_items
        self.window_items = 0.0
        self.window_global_items = 0.0
        self.weighted_window = None


class PreparedOptimizer(WrappedOptimizer):
    """Steps and zeroes only on synchronising micro-steps; steps through the GradScaler under fp16."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        state: GradientState,
        scaler: torch.amp.GradScaler | None,
        after_zero_grad: Callable[[], None] | None = None,
    ) -> None:
        """`after_zero_grad`: called once the gradients of a step are dropped (the engine's memory guard)."""
        # Deliberately no super().__init__: this object is a view on `optimizer`, which keeps all the state.
        self.optimizer = optimizer
        self.after_zero_grad = after_zero_grad
        self.gradient_state = state
        self.scaler = scaler
        self.step_was_skipped = False
        self.steps_taken = 0  # synchronising steps (fp16-skipped ones included): the run's step counter

    def step(self, closure: Any = None) -> Any:
        if not self.gradient_state.sync:
            return None
        self.steps_taken += 1
        if self.scaler is None:
            result = self.optimizer.step(closure)
            self.step_was_skipped = False
        else:
            scale_before = self.scaler.get_scale()
            result = self.scaler.step(self.optimizer, closure) if closure else self.scaler.step(self.optimizer)
            self.scaler.update()
            # The scaler lowers its scale exactly when it found inf/nan gradients and skipped the step.
            self.step_was_skipped = self.scaler.get_scale() < scale_before
        self.gradient_state.optimizer_stepped = not self.step_was_skipped
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            if self.after_zero_grad is not None:
                self.after_zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def train(self) -> None:
        """Pass `train()` on, for optimizers that have one (schedule-free optimizers switch their weights)."""
        switch = getattr(self.optimizer, "train", None)
        if callable(switch):
            switch()

    def eval(self) -> None:
        """Pass `eval()` on, for optimizers that have one (schedule-free: evaluate at the averaged weights)."""
        switch = getattr(self.optimizer, "eval", None)
        if callable(switch):
            switch()

    def __getattr__(self, name: str) -> Any:
        # Anything else the user's optimizer has (its own methods and attributes) is reached through the view.
        if name == "optimizer":  # (not set yet: during unpickling or construction)
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps the wrapped LR scheduler once per real optimizer step.

    `steps_per_step`: scheduler steps per optimizer step (Accelerate's convention without split batches: one per
    process, since the scheduler was written for one process's batches); `with_optimizer=False` steps it at every
    call, as the user wrote it.
    """

    def __init__(
        self, scheduler: Any, state: GradientState, steps_per_step: int = 1, with_optimizer: bool = True
    ) -> None:
        self.scheduler = scheduler
        self.gradient_state = state
        self.steps_per_step = steps_per_step
        self.with_optimizer = with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if self.gradient_state.sync and self.gradient_state.optimizer_stepped:
            # The optimizer did step, perhaps through a rebuilt copy (ZeRO-1/2) torch's check cannot see.
            optimizer = getattr(self.scheduler, "optimizer", None)
            if optimizer is not None:
                optimizer._opt_called = True
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR fails past its last step
            for _ in range(self.steps_per_step):
                if total is None or self.scheduler._step_count <= total:
                    self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)
