"""Plain `nn.Sequential` stacks and tied-weight transformers models in sharded and pipelined runs."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshkit import Engine
from tests.helpers.distributed import leave_world
from tests.helpers.hf_layouts import batches, make_optimizer
from tests.helpers.hf_models import causal_lm

STEPS, GLOBAL_BATCH = 4, 8


def stack() -> nn.Sequential:
    """The most common user model: Linear, activation, Linear, ... (no ModuleList, no names to go by)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def regression_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 8, generator=generator)
        out.append((x, torch.sin(x[:, :4]) + x[:, 4:] * 0.5))
    return out


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def stack_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    model = stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in regression_batches():
        loss = mse(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def run_stack(rank: int, layout: dict) -> dict:
    """Losses, full weights, FSDP units and this rank's parameter bytes of the stack under `layout`."""
    dist.init_process_group("gloo")
    engine = Engine(seed=0, **layout)
    model = stack()
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn=mse)
    local = GLOBAL_BATCH // engine.dp_size
    losses = []
    for x, y in regression_batches():
        part = slice(engine.dp_rank * local, (engine.dp_rank + 1) * local)
        losses.append(engine.reduce(engine.train_step((x[part], y[part]))).item())
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    units = sorted(name for name, m in engine.unwrap_model().named_modules() if isinstance(m, FSDPModule))
    out = {"losses": losses, "state": engine.full_state_dict(), "units": units, "held": held, "total": total_bytes}
    engine.end()
    leave_world()
    return out


def run_tied(rank: int, layout: dict, directory: str, asynchronous: bool) -> dict:
    """GPT-2 (tied embedding and head): 2 steps, save_state, 2 steps; then a fresh engine loads and redoes them."""
    dist.init_process_group("gloo")
    steps = batches()

    def engine_and_model() -> tuple[Engine, nn.Module]:
        engine = Engine(seed=0, **layout)
        model = causal_lm("gpt2")
        model, _ = engine.prepare(model, make_optimizer(model))
        return engine, model

    def train(engine: Engine, chosen: list[dict]) -> list[float]:
        local = len(chosen[0]["input_ids"]) // engine.dp_size
        part = slice(engine.dp_rank * local, (engine.dp_rank + 1) * local)
        losses = []
        for batch in chosen:
            losses.append(engine.train_step({k: v[part] for k, v in batch.items()}).item())
            full = engine.full_state_dict()
            assert torch.equal(full["transformer.wte.weight"], full["lm_head.weight"]), "tied copies drifted apart"
        return losses

    engine, _ = engine_and_model()
    train(engine, steps[:2])
    engine.save_state(Path(directory) / "ckpt", asynchronous=asynchronous)
    first = train(engine, steps[2:])
    first_state = engine.full_state_dict()
    engine.save_model(Path(directory) / "export")  # Hugging Face layout, tied weights as from_pretrained reads them
    engine.end()
    engine, _ = engine_and_model()
    engine.load_state(Path(directory) / "ckpt")
    second = train(engine, steps[2:])
    second_state = engine.full_state_dict()
    engine.end()
    leave_world()
    return {"first": first, "second": second, "first_state": first_state, "second_state": second_state}
