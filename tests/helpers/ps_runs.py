"""Rank functions for the parameter-server tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from meshkit import Engine
from meshkit.paramserver import ParameterServerError
from meshkit.paramserver.placement import serve_report


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def dataset(samples: int = 160) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=generator)
    return TensorDataset(x, (x @ torch.randn(6, 3, generator=generator)).tanh())


def mse(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(output, batch[1])


def train(
    rank: int, overrides: dict[str, Any], steps: int, micro_batch: int, options: dict[str, Any]
) -> dict[str, Any]:
    """`steps` optimizer steps of SGD with momentum and a step LR schedule; the final weights and what the
    engine reports. options: jitter_s (sleep up to that long per step, seeded by rank), die_at (a worker
    index and step at which that worker SIGKILLs itself), checkpoint_every, resume."""
    engine = Engine(**{"hang_doctor": False, **overrides})
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=options.get("lr", 0.05), momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(dataset(options.get("samples", 160)), batch_size=micro_batch, shuffle=True)
    if rank == 0 and options.get("server_dies_after_s"):
        threading.Timer(options["server_dies_after_s"], os.kill, (os.getpid(), signal.SIGKILL)).start()
    losses: list[float] = []
    try:
        net, optimizer, loader, scheduler = engine.prepare(
            net, optimizer, loader, scheduler, loss_fn=lambda out, batch: mse(out, batch)
        )
        if options.get("resume"):
            engine.resume()
        _loop(engine, loader, steps, losses, rank, options)
    except ParameterServerError as err:  # the fault tests: what a rank says when a peer is lost
        engine.end(wait_for_peers=False)
        return {"is_worker": engine.is_worker, "error": str(err), "losses": losses}
    report = serve_report(engine.placement)
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    result = {
        "is_worker": engine.is_worker,
        "weights": weights,
        "losses": losses,
        "lr": float(scheduler.get_last_lr()[0]),
        "staleness": dict(report.staleness) if report else {},
        "dead": list(report.dead_workers) if report else [],
    }
    engine.end()
    return result


def _loop(engine: Engine, loader: Any, steps: int, losses: list[float], rank: int, options: dict[str, Any]) -> None:
    jitter = random.Random(rank)
    while engine.is_worker and engine.step < steps:
        for batch in loader:
            if options.get("die_at") == (engine.dp_rank, engine.step):
                os.kill(os.getpid(), signal.SIGKILL)
            if options.get("pause_at") == (engine.dp_rank, engine.step):  # e.g. a long evaluation
                time.sleep(options["pause_s"])
            if options.get("jitter_s"):
                time.sleep(jitter.random() * options["jitter_s"])
            losses.append(float(engine.train_step((batch[0], batch))))
            if options.get("checkpoint_every"):
                engine.save_checkpoint()
            if engine.step >= steps:
                break


def logistic_data(samples: int = 240, features: int = 8) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(samples, features, generator=generator)
    y = ((x @ torch.randn(features, generator=generator) + 0.3 * torch.randn(samples, generator=generator)) > 0).float()
    return TensorDataset(x, y)


def logistic_loss(weights: dict[str, torch.Tensor], data: TensorDataset) -> float:
    x, y = data.tensors
    logits = x @ weights["weight"].reshape(-1) + weights["bias"]
    return float(nn.functional.binary_cross_entropy_with_logits(logits, y))


def train_logistic(rank: int, overrides: dict[str, Any], epochs: int, jitter_s: float) -> dict[str, Any]:
    """Logistic regression (a convex problem), plain SGD at lr 0.5, `epochs` passes over the data; each worker
    sleeps a random time of up to `jitter_s` per step (workers of different speeds)."""
    engine = Engine(hang_doctor=False, **overrides)
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    loader = DataLoader(logistic_data(), batch_size=8, shuffle=True)
    net, optimizer, loader = engine.prepare(
        net,
        optimizer,
        loader,
        loss_fn=lambda out, batch: nn.functional.binary_cross_entropy_with_logits(out.reshape(-1), batch[1]),
    )
    jitter = random.Random(rank)
    for _ in range(epochs if engine.is_worker else 0):
        for batch in loader:
            time.sleep(jitter.random() * jitter_s)
            engine.train_step((batch[0], batch))
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    report = serve_report(engine.placement)
    engine.end()
    return {"is_worker": engine.is_worker, "weights": weights, "staleness": dict(report.staleness) if report else {}}
