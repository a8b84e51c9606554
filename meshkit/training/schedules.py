"""The fine-tune's learning-rate schedule by name: every transformers `get_scheduler` schedule that steps without
a metric, and Axolotl's `one_cycle` (torch's OneCycleLR, `lr_div_factor` its starting divisor); warm-up from
`warmup_steps` or `warmup_ratio`. Axolotl's cosine variants: `cosine_min_lr_ratio` (a floor),
`cosine_constant_lr_ratio` with it (the floor reached at that share of the steps and held), and
`lr_quadratic_warmup` (the warm-up rises as the square of its progress). Axolotl's jagged restarts (ReLoRA's
schedule, `jagged_restarts`) on any of them but one_cycle."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field, field_validator

from meshkit.config.section import Section


class JaggedRestartSettings(Section):
    """Axolotl's jagged learning-rate restarts (`jagged_restarts`)."""

    jagged_restart_steps: int | None = Field(None, ge=1, description="every how many steps the lr restarts")
    jagged_restart_warmup_steps: int | None = Field(None, ge=1, description="warm-up steps after a restart (10)")
    jagged_restart_anneal_steps: int | None = Field(None, ge=1, description="steps annealed before a restart (1)")

    @field_validator("jagged_restart_warmup_steps", "jagged_restart_anneal_steps", mode="before")
    @classmethod
    def _off_means_the_default(cls, value: Any) -> Any:
        """Axolotl reads `false` or 0 here as its default (10 warm-up steps, 1 annealing step)."""
        return None if value in (False, 0) else value


SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "one_cycle",
)


def warmup_steps(steps: int, ratio: float | None, total: int) -> int:
    """`warmup_ratio` of the total steps (rounded up) when given, else `warmup_steps`."""
    return math.ceil(ratio * total) if ratio is not None else steps


def build_schedule(
    name: str,
    optimizer: torch.optim.Optimizer,
    *,
    warmup: int,
    total: int,
    kwargs: dict[str, Any] | None = None,
    min_lr_ratio: float | None = None,
    constant_lr_ratio: float | None = None,
    quadratic_warmup: bool = False,
    div_factor: float | None = None,
) -> Any:
    """The schedule `name` over `total` optimizer steps. For cosine, as Axolotl picks: `quadratic_warmup` first,
    then `min_lr_ratio` with `constant_lr_ratio`, then `min_lr_ratio` alone (transformers' cosine_with_min_lr)."""
    options = dict(kwargs or {})
    if name == "one_cycle":
        lrs = [group["lr"] for group in optimizer.param_groups]
        pct = max(warmup, 1) / max(total, 1)
        if div_factor is not None:
            options.setdefault("div_factor", div_factor)
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lrs, total_steps=max(total, 1), pct_start=min(pct, 0.99), **options
        )
    if name == "cosine" and quadratic_warmup:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine_after_quadratic_warmup(warmup, total))
    if name == "cosine" and min_lr_ratio is not None and constant_lr_ratio is not None:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, _cosine_to_a_held_floor(warmup, total, constant_lr_ratio, min_lr_ratio)
        )
    from transformers import get_scheduler

    if min_lr_ratio is not None and name in ("cosine", "cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        name = "cosine_with_min_lr" if name == "cosine" else name
        options.setdefault("min_lr_rate", min_lr_ratio)
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total,
        scheduler_specific_kwargs=options or None,
    )


def _cosine_after_quadratic_warmup(warmup: int, total: int) -> Any:
    """The lr factor: (step / warmup)² during the warm-up, then a half cosine from 1 to 0 over the rest."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step / max(1, warmup)) ** 2
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor


def _cosine_to_a_held_floor(warmup: int, total: int, constant_ratio: float, floor: float) -> Any:
    """The lr factor: linear warm-up, a half cosine from 1 down to `floor` reached at `constant_ratio` of the
    steps, then `floor` held (continual pre-training's re-warming schedule, as Axolotl defines it)."""
    held_from = int(total * constant_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (min(step, held_from) - warmup) / max(1, held_from - warmup)
        return max(0.0, (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))) + floor

    return factor


def jagged_restarts(
    schedule: Any, every: int, warmup: int | None, anneal: int | None, floor: float | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """`schedule` times Axolotl's jagged-restart factor: after the first `every - anneal` steps, each window of
    `every` steps rises linearly from `floor` over its first `warmup` steps (10) and falls back to it over its last
    `anneal` (1). `floor` is `cosine_min_lr_ratio` when set, else 0.001."""
    lambdas = getattr(schedule, "lr_lambdas", None)
    if lambdas is None:
        raise ValueError(
            f"jagged_restart_steps scales a schedule given by a factor per step; {type(schedule).__name__} "
            "(one_cycle) is not one: choose another lr_scheduler"
        )
    factor = _jagged_factor(every, warmup or 10, anneal or 1, 0.001 if floor is None else floor)
    return torch.optim.lr_scheduler.LambdaLR(schedule.optimizer, [_scaled(inner, factor) for inner in lambdas])


def _scaled(inner: Callable[[int], float], factor: Callable[[int], float]) -> Callable[[int], float]:
    return lambda step: inner(step) * factor(step)


def _jagged_factor(every: int, warmup: int, anneal: int, floor: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < every - anneal:
            return 1.0
        into = step % every
        if into < warmup:
            rise = into / warmup
        elif into > every - anneal:
            rise = min(1.0, (every - into) / anneal)
        else:
            rise = 1.0
        return rise * (1 - floor) + floor

    return factor
