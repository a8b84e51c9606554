"""Gradient accumulation: 4 micro-steps at world 2 equal one step of the 8x global batch at world 1."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from meshkit import Engine
from meshkit.models.gpt import lm_loss
from tests.helpers.distributed import run_world
from tests.helpers.training import (
    assert_close_relative,
    assert_state_close,
    make_optimizer,
    split,
    tiny_gpt,
    token_batches,
)

WORLD, ACCUM, MICRO, OPT_STEPS = 2, 4, 2, 3
GLOBAL = WORLD * ACCUM * MICRO


def lr_factor(step: int) -> float:
    return 1.0 / (1 + step)


def dataset() -> TensorDataset:
    tokens = torch.cat(token_batches(OPT_STEPS, GLOBAL))  # [OPT_STEPS * GLOBAL, seq + 1]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def reference() -> tuple[list[float], dict, list[float]]:
    torch.set_num_threads(1)
    model = tiny_gpt()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    losses, lrs = [], []
    for inputs, targets in DataLoader(dataset(), batch_size=GLOBAL):
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
    return losses, model.state_dict(), lrs


def accumulating_rank(rank: int) -> dict:
    engine = Engine(seed=0, grad_accum_steps=ACCUM, logging={"dir": "/tmp/meshkit-test-runs"})
    model = tiny_gpt()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model, optimizer, loader, scheduler = engine.prepare(
        model, optimizer, DataLoader(dataset(), batch_size=MICRO), scheduler
    )
    losses, lrs, window, syncs = [], [], torch.zeros(()), []
    for inputs, targets in loader:
        with engine.accumulate():
            loss = lm_loss(model(inputs), targets)
            engine.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        syncs.append(engine.sync_gradients)
        window += loss.detach()
        if engine.sync_gradients:
            losses.append(engine.reduce(window / ACCUM).item())
            lrs.append(scheduler.get_last_lr()[0])
            window.zero_()
    result = {
        "losses": losses,
        "lrs": lrs,
        "syncs": syncs,
        "scheduler_steps": scheduler.scheduler.last_epoch,
        "state": engine.full_state_dict(),
    }
    engine.end()
    return result


def test_accumulation_at_world_2_equals_world_1_with_the_global_batch() -> None:
    expected_losses, expected_state, expected_lrs = reference()
    for result in run_world(accumulating_rank, WORLD, timeout=180):
        assert result["syncs"] == [False, False, False, True] * OPT_STEPS
        assert result["scheduler_steps"] == OPT_STEPS  # once per optimizer step, not per micro-step
        assert result["lrs"] == expected_lrs
        assert_close_relative(result["losses"], expected_losses, 1e-5)
        assert_state_close(result["state"], expected_state, 1e-5)


def item_weighted_rank(rank: int) -> dict:
    """Micro-batches with different numbers of real tokens (the rest masked with -100)."""
    engine = Engine(seed=0, grad_accum_steps=2, logging={"dir": "/tmp/meshkit-test-runs"})
    model = tiny_gpt()
    model, optimizer = engine.prepare(model, make_optimizer(model))
    for inputs, targets in masked_micro_batches()[rank]:
        with engine.accumulate():
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            engine.backward(loss, num_items=int((targets != -100).sum()))
            optimizer.step()
            optimizer.zero_grad()
    state = engine.full_state_dict()
    engine.end()
    return state


def masked_micro_batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """[rank][micro] -> (inputs, targets); rank 0 keeps few tokens, rank 1 many."""
    batches = token_batches(4, 2)
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    for index, batch in enumerate(batches):
        inputs, targets = split(batch)
        targets = targets.clone()
        keep = [3, 5, 14, 16][index]
        targets[:, keep:] = -100
        out[index // 2].append((inputs, targets))
    return out


def test_item_weighted_accumulation_averages_over_every_token() -> None:
    torch.set_num_threads(1)
    model = tiny_gpt()
    optimizer = make_optimizer(model)
    pairs = [pair for rank in masked_micro_batches() for pair in rank]
    inputs = torch.cat([p[0] for p in pairs])
    targets = torch.cat([p[1] for p in pairs])
    loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    optimizer.step()
    for state in run_world(item_weighted_rank, 2, timeout=180):
        assert_state_close(state, model.state_dict(), 1e-5)


def static_graph_rank(rank: int, static: bool, manual: bool) -> dict:
    engine = Engine(hang_doctor=False, grad_accum_steps=2, ddp={"static_graph": static})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net, optimizer = engine.prepare(net, optimizer, loss_fn=torch.nn.functional.mse_loss)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(8):
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
        if manual:  # the hand-written loop
            with engine.accumulate():
                engine.backward(torch.nn.functional.mse_loss(net(x), y))
                optimizer.step()
                optimizer.zero_grad()
        else:
            engine.train_step((x, y))
    weights = {name: p.detach().clone() for name, p in net.named_parameters()}
    engine.end()
    return weights


def test_ddp_static_graph_with_accumulation_equals_the_eager_graph() -> None:
    """torch's no_sync fails under a static graph: meshkit reduces every micro-step, with the same result."""
    eager = run_world(static_graph_rank, 2, False, False)[0]
    for manual in (False, True):
        static = run_world(static_graph_rank, 2, True, manual)[0]
        assert_state_close(static, eager, 1e-6)
