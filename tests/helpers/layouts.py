"""Train several layouts in one gloo world and compare each with a single-process run of the same batch."""

from __future__ import annotations

import torch
from torch import nn

from meshkit import Engine
from meshkit.models.gpt import GPT, lm_loss
from tests.helpers.distributed import leave_world
from tests.helpers.hf_style import TinyDecoder, TinyGPT2
from tests.helpers.misnamed import MisnamedDecoder
from tests.helpers.training import (
    TINY,
    assert_close_relative,
    assert_state_close,
    make_optimizer,
    split,
    tiny_gpt,
    token_batches,
)

STEPS, GLOBAL_BATCH = 5, 4


# SGD with momentum (tests.helpers.training.make_optimizer): Adam would turn the exactly-zero gradient of the key bias
# (softmax ignores a shift of all scores) into ±lr steps of pure rounding noise.
def tiny_gpt_4_blocks() -> nn.Module:
    return GPT(TINY.model_copy(update={"n_layers": 4}))


MODELS = {
    "gpt": tiny_gpt,
    "gpt4": tiny_gpt_4_blocks,
    "hf": TinyDecoder,
    "gpt2": TinyGPT2,
    "misnamed": MisnamedDecoder,
}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]()


def reference(kind: str) -> tuple[list[float], dict]:
    torch.set_num_threads(1)
    model = build(kind)
    optimizer = make_optimizer(model)
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def run_layouts(rank: int, layouts: dict) -> dict:
    """Each layout's losses and full weights on this rank (in the caller's process group, if it has one)."""
    owns_group = not torch.distributed.is_initialized()
    if owns_group:
        torch.distributed.init_process_group("gloo")
    out = {}
    for name, (kind, overrides) in layouts.items():
        engine = Engine(seed=0, **overrides)
        model = build(kind)
        model, _ = engine.prepare(model, make_optimizer(model), loss_fn=lm_loss)
        local = GLOBAL_BATCH // engine.dp_size
        losses = []
        for batch in token_batches(STEPS, GLOBAL_BATCH):
            part = batch[engine.dp_rank * local : (engine.dp_rank + 1) * local]
            losses.append(engine.reduce(engine.train_step(split(part))).item())
        out[name] = {"losses": losses, "state": engine.full_state_dict()}
        engine.end()
    if owns_group:
        leave_world()
    return out


def check(results: list[dict], name: str, kind: str) -> None:
    expected_losses, expected_state = reference(kind)
    for rank_results in results:
        assert_close_relative(rank_results[name]["losses"], expected_losses, 1e-4)
        assert_state_close(rank_results[name]["state"], expected_state, 1e-4)
