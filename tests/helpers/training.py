"""Shared pieces of the equivalence tests: a tiny GPT, fixed data, a plain single-process reference run."""

from __future__ import annotations

import torch

from meshkit.models.gpt import GPT, GPTConfig, lm_loss

TINY = GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def token_batches(steps: int, global_batch: int, seq_len: int = 16, seed: int = 123) -> list[torch.Tensor]:
    """`steps` batches of [global_batch, seq_len + 1] tokens: counting sequences with a random start and stride,
    so the next token is predictable and the loss falls within a few steps."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_len + 1)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, TINY.vocab_size, (global_batch, 1), generator=generator)
        stride = torch.randint(1, 4, (global_batch, 1), generator=generator)
        batches.append((start + stride * positions) % TINY.vocab_size)
    return batches


def split(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[:, :-1], batch[:, 1:]


def make_optimizer(model: torch.nn.Module, kind: str = "sgd") -> torch.optim.Optimizer:
    """SGD with momentum passes gradients through linearly, so a sync error shows at its true size. Adam
    divides by sqrt(v): for near-zero gradients it magnifies the ~1e-7 rounding of a different reduction
    order, so Adam comparisons need a looser bound on the weights."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def reference_run(batches: list[torch.Tensor], kind: str = "sgd") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch, one process, the whole global batch per step."""
    torch.set_num_threads(1)
    model = tiny_gpt()
    optimizer = make_optimizer(model, kind)
    losses = []
    for batch in batches:
        inputs, targets = split(batch)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close_relative(actual: list[float], expected: list[float], tol: float) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert abs(a - e) <= tol * abs(e), f"step {step}: loss {a} vs {e} (relative {abs(a - e) / abs(e):.2e})"


def assert_state_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        err = (actual[name] - tensor).norm() / tensor.norm().clamp_min(1e-12)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


def train_recipe(rank: int, config: str, assignments: list[str]) -> dict:
    """In a spawned rank: what `meshkit train` runs on each rank (`python -m meshkit.recipes.train`); its summary.
    The uninterrupted reference of a launcher-level test, without a launcher's start-up."""
    from meshkit.recipes.train import resolve_recipe, train

    return train(resolve_recipe(config, assignments))
