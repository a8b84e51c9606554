"""The fine-tune's learning-rate schedule by name: every transformers `get_scheduler` schedule that steps without
a metric, and Axolotl's `one_cycle` (torch's OneCycleLR); warm-up from `warmup_steps` or `warmup_ratio`."""

from __future__ import annotations

import math
from typing import Any

import torch

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
) -> Any:
    """The schedule `name` over `total` optimizer steps. `cosine_min_lr_ratio` turns cosine into transformers'
    cosine_with_min_lr (floor = ratio × lr), as Axolotl does."""
    options = dict(kwargs or {})
    if name == "one_cycle":
        lrs = [group["lr"] for group in optimizer.param_groups]
        pct = max(warmup, 1) / max(total, 1)
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lrs, total_steps=max(total, 1), pct_start=min(pct, 0.99), **options
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
