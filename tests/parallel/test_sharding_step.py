"""Sharded layouts through the whole step: accumulation, clipping, token weighting, fp16 and bf16."""

from __future__ import annotations

import torch

from meshkit import Engine
from meshkit.models.gpt import lm_loss
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.training import assert_close_relative, assert_state_close, split, tiny_gpt, token_batches

LAYOUTS = {"ddp": {}, "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}


def accumulate_and_clip(rank: int) -> dict:
    torch.distributed.init_process_group("gloo")
    out = {}
    for name, overrides in LAYOUTS.items():
        engine = Engine(seed=0, grad_accum_steps=2, max_grad_norm=0.05, **overrides)
        model = tiny_gpt()
        model, _ = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=lm_loss)
        losses = []
        for batch in token_batches(8, 4):  # 4 optimizer steps of 2 micro-steps, 2 sequences per rank each
            losses.append(engine.reduce(engine.train_step(split(batch[rank * 2 : rank * 2 + 2]))).item())
        out[name] = {"losses": losses, "state": engine.full_state_dict()}
        engine.end()
    leave_world()
    return out


def test_accumulation_and_clipping_match_ddp_on_every_stage() -> None:
    for result in run_world(accumulate_and_clip, 2, timeout=240):
        for name in ("zero1", "zero2", "zero3"):
            assert_close_relative(result[name]["losses"], result["ddp"]["losses"], 1e-5)
            assert_state_close(result[name]["state"], result["ddp"]["state"], 1e-5)


def with_a_frozen_layer(rank: int) -> dict:
    """The optimizer given every parameter, one layer frozen (as a fine-tune freezes embeddings), AdamW with weight
    decay: torch never steps a parameter without a gradient, so the frozen layer must not move."""
    torch.distributed.init_process_group("gloo")
    out = {}
    for name in ("ddp", "zero1", "zero2"):
        engine = Engine(seed=0, **LAYOUTS[name])
        model = tiny_gpt()
        model.layers[0].requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, _ = engine.prepare(model, optimizer, loss_fn=lm_loss)
        for batch in token_batches(3, 4):
            engine.train_step(split(batch[rank * 2 : rank * 2 + 2]))
        out[name] = engine.full_state_dict()
        engine.end()
    leave_world()
    return out


def test_a_frozen_layer_in_the_optimizer_stays_put_on_every_stage() -> None:
    frozen = {k: v for k, v in tiny_gpt().state_dict().items() if k.startswith("layers.0.")}
    for result in run_world(with_a_frozen_layer, 2, timeout=240):
        for name in ("ddp", "zero1", "zero2"):
            assert all(torch.equal(result[name][k], v) for k, v in frozen.items()), name
            assert_state_close(result[name], result["ddp"], 1e-5)


def fp16_skip(rank: int, stage: int) -> dict:
    engine = Engine(seed=0, zero_stage=stage, precision="fp16")
    model = tiny_gpt()
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs, targets = split(token_batches(1, 4)[0][rank * 2 : rank * 2 + 2])
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.backward(lm_loss(model(inputs), targets))
    if rank == 1:  # only one rank sees an overflow: every rank must still skip
        for param in [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]:
            if param.grad is not None:
                local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                local.view(-1)[0] = float("inf")
                break
    engine.clip_grad_norm_(1.0)
    optimizer.step()
    skipped = optimizer.step_was_skipped
    unchanged = all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    engine.end()
    return {"skipped": skipped, "unchanged": unchanged}


def test_fp16_overflow_on_one_rank_skips_the_step_on_all() -> None:
    for stage in (2, 3):
        for result in run_world(fp16_skip, 2, stage, timeout=180):
            assert result == {"skipped": True, "unchanged": True}, stage


def bf16_zero3(rank: int) -> list[float]:
    engine = Engine(seed=0, zero_stage=3, precision="bf16")
    model = tiny_gpt()
    model, _ = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3), loss_fn=lm_loss)
    batch = split(token_batches(1, 4)[0][rank * 2 : rank * 2 + 2])
    losses = [engine.reduce(engine.train_step(batch)).item() for _ in range(20)]
    dtype = next(p for p in engine.unwrap_model().parameters()).dtype
    engine.end()
    return [*losses, float(dtype == torch.float32)]


def test_bf16_with_zero3_trains_with_fp32_sharded_weights() -> None:
    for result in run_world(bf16_zero3, 2, timeout=180):
        *losses, fp32_master = result
        assert fp32_master == 1.0 and losses[-1] < 0.7 * losses[0]


def plain_backward_rank(rank: int) -> str:
    engine = Engine(zero_stage=2)
    model = tiny_gpt()
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs, targets = split(token_batches(1, 4)[0][rank * 2 : rank * 2 + 2])
    lm_loss(model(inputs), targets).backward()  # bypasses the engine: nothing would reduce the gradients
    try:
        optimizer.step()
    except ValueError as err:
        return str(err)
    finally:
        engine.end()
    return "stepped"


def test_zero_refuses_to_step_on_gradients_it_did_not_reduce() -> None:
    for message in run_world(plain_backward_rank, 2, timeout=120):
        assert message == "zero_stage 2 reduces gradients in engine.backward(loss): call it instead of loss.backward()"
