"""An expert bank that no token of one rank's batch reaches (LongCat-Flash's zero-computation experts do this to
a tiny model) still trains as in one process under DDP and ZeRO-3, also in a step where no token of the whole batch
reaches it: its gradient is then absent, as in one process, so momentum does not move it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

from meshkit import Engine
from meshkit.models.structure import describe
from meshkit.parallel.replicate import GradientAllReduce
from tests.helpers.distributed import gloo_world, run_world
from tests.helpers.training import assert_close_relative, assert_state_close

VOCAB, WIDTH, SEQ = 16, 8, 6
# tokens below 8 go to expert 0 (which computes with the bank), the others to expert 1 (the identity, no weights)
BATCHES = [
    torch.tensor(
        [[1, 2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7, 1], [9, 10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 14, 15, 9]]
    ),
    torch.tensor([[9, 10, 11, 12, 13, 14, 15], [11, 12, 13, 14, 15, 9, 10], [12, 13, 14, 15, 9, 10, 11], [13] * 7]),
    torch.tensor(
        [[3, 4, 5, 6, 7, 1, 2], [12, 13, 14, 15, 9, 10, 11], [4, 5, 6, 7, 1, 2, 3], [14, 15, 9, 10, 11, 12, 13]]
    ),
]


class Bank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, WIDTH, WIDTH) * 0.3)


class ZeroExpertMoE(nn.Module):
    """Top-1 routing over a real expert (0) and one that returns its input (1), each output times its gate."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, 2, bias=False)
        self.experts = Bank()
        with torch.no_grad():
            self.router.weight.zero_()
            self.router.weight[0, 0], self.router.weight[1, 0] = 4.0, -4.0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probabilities = self.router(hidden).softmax(-1)
        chosen = probabilities.argmax(-1)
        out = torch.zeros_like(hidden)
        for expert in chosen.unique().tolist():  # (the bank is read only where a token chose the real expert)
            mask = chosen == expert
            gate = probabilities[..., expert][mask].unsqueeze(-1)
            out[mask] = gate * (hidden[mask] @ self.experts.weight[0] if expert == 0 else hidden[mask])
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = ZeroExpertMoE()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.moe(self.norm(hidden))


class TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        with torch.no_grad():  # (feature 0 says which expert a token goes to, far from the boundary)
            self.embed.weight.mul_(0.1)
            self.embed.weight[:8, 0], self.embed.weight[8:, 0] = 3.0, -3.0
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def one_process() -> tuple[list[float], dict[str, torch.Tensor], list[bool]]:
    model, reached = TinyMoE(), []
    optimizer = optimizer_of(model)
    losses = []
    for batch in BATCHES:
        loss = loss_of(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        reached.append(model.blocks[0].moe.experts.weight.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, reached


def _layouts(rank: int) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    out = {}
    with gloo_world():
        for name, settings in {"ddp": {}, "zero3": {"zero_stage": 3}}.items():
            engine = Engine(seed=0, **settings)
            model = TinyMoE()
            model, _ = engine.prepare(model, optimizer_of(model), loss_fn=loss_of)
            losses = []
            for batch in BATCHES:
                part = batch[rank * 2 : rank * 2 + 2]
                losses.append(engine.reduce(engine.train_step((part[:, :-1], part[:, 1:])).detach()).item())
            out[name] = (losses, {k: v.detach().clone() for k, v in engine.full_state_dict().items()})
            engine.end()
    return out


def test_the_structure_layer_reads_the_tiny_model_as_a_mixture_of_experts() -> None:
    facts = describe(TinyMoE()).moe
    assert [(f.path, f.bank, f.experts) for f in facts] == [
        ("blocks.0.moe", "experts", 2),
        ("blocks.1.moe", "experts", 2),
    ]
    assert not any(f.uneven for f in facts)


def test_a_bank_with_rows_for_experts_that_compute_nothing_is_read_as_uneven() -> None:
    model = TinyMoE()
    for block in model.blocks:  # (LongCat's gate/up holds rows for every expert, its down projection the real ones)
        block.moe.router = nn.Linear(WIDTH, 5, bias=False)
        block.moe.experts.weight = nn.Parameter(torch.zeros(5, WIDTH, WIDTH))
        block.moe.experts.down = nn.Parameter(torch.zeros(2, WIDTH, WIDTH))
    assert [(f.experts, f.uneven) for f in describe(model).moe] == [(5, True), (5, True)]


def _partly_present(rank: int) -> list[list[float] | None]:
    """Three parameters: a gradient on both ranks, on rank 0 only, on neither."""
    with gloo_world():
        params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
        params[0].grad = torch.full((2,), float(rank + 1))
        if rank == 0:
            params[1].grad = torch.full((2,), 4.0)
        GradientAllReduce(params, torch.distributed.group.WORLD).reduce_gradients()
        return [None if param.grad is None else param.grad.tolist() for param in params]


@pytest.mark.world
def test_the_all_reduce_of_a_pipeline_or_tensor_parallel_agrees_on_the_gradients_present() -> None:
    for grads in run_world(_partly_present, 2, timeout=60):
        assert grads == [[1.5, 1.5], [2.0, 2.0], None]  # (the average of 4 and a zero; none stays none)


@pytest.mark.world
def test_a_bank_one_rank_never_reaches_trains_as_in_one_process() -> None:
    losses, state, reached = one_process()
    assert reached == [True, False, True]  # (step 2: no token of the whole batch reaches the bank)
    for result in run_world(_layouts, 2, timeout=240):
        assert set(result) == {"ddp", "zero3"}
        for got_losses, got_state in result.values():
            assert_close_relative(got_losses, losses, 1e-5)
            assert_state_close(got_state, state, 1e-5)
