"""Expert-parallel runs that save, resume at another ep size, and export (workers for run_world)."""

from __future__ import annotations

from pathlib import Path

import torch

from meshkit import Engine
from tests.helpers.distributed import gloo_world, leave_world
from tests.helpers.hf_layouts import batches, build, make_optimizer, rank_part, train_steps


def _engine(family: str, overrides: dict) -> tuple[Engine, torch.nn.Module]:
    engine = Engine(seed=0, **overrides)
    model = build(family)
    model, _ = engine.prepare(model, make_optimizer(model))
    return engine, model


def save_then_resume(rank: int, family: str, first: dict, second: dict, directory: str) -> dict:
    """Two steps in layout `first`, save_state and save_model; two more in layout `second` from the checkpoint."""
    torch.distributed.init_process_group("gloo")
    all_batches = batches()
    engine, _ = _engine(family, first)
    losses = train_steps(engine, all_batches[:2])
    engine.save_state(Path(directory) / "state")
    engine.save_model(Path(directory) / "export")
    saved = engine.full_state_dict()
    engine.end()
    engine, _ = _engine(family, second)
    engine.load_state(Path(directory) / "state")
    resumed = engine.full_state_dict()
    losses += train_steps(engine, all_batches[2:])
    out = {"losses": losses, "saved": saved, "resumed": resumed, "state": engine.full_state_dict()}
    engine.end()
    leave_world()
    return out


def train_then_save(rank: int, family: str, layout: dict, directory: str) -> list[float]:
    """Two steps in `layout`, then save_state: the losses."""
    with gloo_world():
        engine, _ = _engine(family, layout)
        losses = train_steps(engine, batches()[:2])
        engine.save_state(Path(directory))
        engine.end()
    return losses


def resume_then_train(rank: int, family: str, layouts: dict[str, dict], directory: str) -> dict:
    """Per layout: load_state from `directory` and the last two steps (losses and weights), or the refusal."""
    out: dict[str, dict] = {}
    with gloo_world():
        for name, layout in layouts.items():
            engine, _ = _engine(family, layout)
            try:
                engine.load_state(Path(directory))
            except Exception as err:  # noqa: BLE001 - a refusal is a result: the test checks its words
                out[name] = {"refused": str(err)}
            else:
                out[name] = {"losses": train_steps(engine, batches()[2:]), "state": engine.full_state_dict()}
            engine.end()
    return out


def grads_after_backward(rank: int, family: str, overrides: dict) -> dict[str, bool]:
    """Which expert-bank parameters hold a gradient after one backward (the plain loop, no optimizer step)."""
    torch.distributed.init_process_group("gloo")
    engine, model = _engine(family, overrides)
    engine.backward(model(**rank_part(engine, batches()[0])).loss)
    out = {name: param.grad is not None for name, param in model.named_parameters() if "experts" in name}
    engine.end()
    leave_world()
    return out


def plain_loop(rank: int, family: str, overrides: dict) -> dict:
    """The loop users already have (`model(**batch).loss`, engine.backward, optimizer.step), in `overrides`."""
    torch.distributed.init_process_group("gloo")
    engine = Engine(seed=0, **overrides)
    model = build(family)
    model, optimizer = engine.prepare(model, make_optimizer(model))
    losses = []
    for batch in batches():
        part = rank_part(engine, batch)
        with engine.accumulate():
            loss = model(**part).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(engine.reduce(loss.detach(), "mean").item())
    out = {"losses": losses, "state": engine.full_state_dict()}
    engine.end()
    leave_world()
    return out


def route_with_capacity(rank: int, capacity_factor: float | None) -> dict:
    """Route.plan and routed_experts in a world of one: 8 tokens, top-2 of 4 experts, all on experts 0 and 1."""
    from meshkit.parallel.expert.dispatch import Route, routed_experts

    torch.distributed.init_process_group("gloo")
    group = torch.distributed.group.WORLD
    top_k_index = torch.tensor([[0, 1]] * 6 + [[2, 1]] * 2)
    weights = torch.full((8, 2), 0.5)
    hidden = torch.arange(8.0).unsqueeze(1).repeat(1, 3)
    route = Route.plan(top_k_index, 4, group, capacity_factor)
    out = routed_experts(hidden, top_k_index, weights, 4, group, lambda x, e, w: x * w, capacity_factor)
    leave_world()
    return {"send": route.send, "kept": route.order.tolist(), "out": out[:, 0].tolist()}
