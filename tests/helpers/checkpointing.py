"""Shared pieces of the checkpoint tests: train some steps at one layout, save, resume at another."""

from __future__ import annotations

from pathlib import Path

import torch

from meshkit import Engine
from meshkit.models.gpt import lm_loss
from tests.helpers.distributed import gloo_world
from tests.helpers.layouts import build
from tests.helpers.training import split, token_batches

STEPS, GLOBAL_BATCH = 6, 4


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def train(rank: int, layout: dict, options: dict) -> dict:
    """`run_world` entry: see `train_steps`."""
    with gloo_world():
        return train_steps(layout, **options)


def train_jobs(rank: int, jobs: dict[str, tuple[dict, dict]]) -> dict[str, dict]:
    """`run_world` entry: several `train_steps` runs, one after another in the same world (one start-up)."""
    with gloo_world():
        return {name: train_steps(layout, **options) for name, (layout, options) in jobs.items()}


def train_steps(
    layout: dict,
    *,
    kind: str = "gpt",
    first: int = 0,
    save_at: int | None = None,
    save_to: str | None = None,
    load_from: str | None = None,
    asynchronous: bool = False,
) -> dict:
    """Steps first..STEPS-1 of the fixed batch sequence; optionally load before, and save after step `save_at`
    (training goes on while an asynchronous save is written). Joins the caller's process group."""
    engine = Engine(seed=0, **layout)
    model = build(kind)
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler, loss_fn=lm_loss)
    if load_from is not None:
        engine.load_state(load_from)
    assert engine.step == first, f"resumed at step {engine.step}, expected {first}"
    local = GLOBAL_BATCH // engine.dp_size
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH)[first:]:
        part = batch[engine.dp_rank * local : (engine.dp_rank + 1) * local]
        losses.append(engine.reduce(engine.train_step(split(part))).item())
        if save_to is not None and engine.step == save_at:
            engine.save_state(save_to, asynchronous=asynchronous, extra={"losses": losses})
    engine.wait_for_checkpoint()
    out = {"losses": losses, "state": engine.full_state_dict(), "lr": scheduler.get_last_lr()[0]}
    engine.end()
    return out


def saved_files(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir())
