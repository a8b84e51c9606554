"""bf16 trains; fp16 scales the loss and skips the step (and the scheduler) on inf gradients."""

from __future__ import annotations

import torch

from meshkit import Engine
from meshkit.models.gpt import lm_loss
from tests.helpers.training import split, tiny_gpt, token_batches


def test_bf16_trains_and_runs_the_forward_in_bf16() -> None:
    with Engine(precision="bf16") as engine:
        model = tiny_gpt()
        seen: list[torch.dtype] = []
        model.layers[0].feed_forward.w1.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3), loss_fn=lm_loss)
        batch = split(token_batches(1, 8)[0])
        losses = [engine.train_step(batch).item() for _ in range(15)]
        assert seen[0] == torch.bfloat16  # matmuls under autocast
        assert model(batch[0]).dtype == torch.float32  # outputs handed back in fp32 for the loss
        assert next(engine.unwrap_model().parameters()).dtype == torch.float32  # fp32 master weights
        assert losses[-1] < 0.7 * losses[0]


def test_fp16_skips_the_step_and_the_scheduler_on_inf_gradients() -> None:
    with Engine(precision="fp16") as engine:
        model = tiny_gpt()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler, loss_fn=lm_loss)
        inputs, targets = split(token_batches(1, 4)[0])
        before = {k: v.clone() for k, v in engine.full_state_dict().items()}
        scale = engine.scaler.get_scale()

        engine.backward(lm_loss(model(inputs), targets))
        model.output.weight.grad[0, 0] = float("inf")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        assert optimizer.step_was_skipped
        assert engine.scaler.get_scale() < scale
        assert scheduler.scheduler.last_epoch == 0
        assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())

        engine.backward(lm_loss(model(inputs), targets))
        optimizer.step()
        scheduler.step()
        assert not optimizer.step_was_skipped
        assert scheduler.scheduler.last_epoch == 1
        assert not torch.equal(before["output.weight"], engine.full_state_dict()["output.weight"])


def test_fp16_clip_grad_norm_unscales_first() -> None:
    with Engine(precision="fp16") as engine:
        model = tiny_gpt()
        model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        inputs, targets = split(token_batches(1, 4)[0])
        engine.backward(lm_loss(model(inputs), targets))
        norm = engine.clip_grad_norm_(1e9)
        reference = tiny_gpt()
        lm_loss(reference(inputs), targets).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
        # the reported norm is of the unscaled gradients (fp16 forward: loose tolerance)
        assert abs(norm.item() - expected.item()) < 0.05 * expected.item()
