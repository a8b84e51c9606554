"""ZeRO-3 on a model without a list of repeated blocks: FSDP shards its children as units (one notice line), and
two ranks train as one process does."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_world


class TwoPartNet(torch.nn.Module):
    """No nn.ModuleList or nn.Sequential of repeated blocks: an encoder and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def train_rank(rank: int, zero_stage: int) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    import warnings

    from meshkit import Engine

    torch.manual_seed(0)
    model = TwoPartNet()
    inputs, targets = torch.randn(8, 16), torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = Engine(seed=0, zero_stage=zero_stage)
        prepared, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_mse)
    share = 8 // engine.dp_size
    mine = slice(engine.dp_rank * share, (engine.dp_rank + 1) * share)
    losses = [float(engine.train_step((inputs[mine], targets[mine]))) for _ in range(3)]
    weights = engine.full_state_dict()
    engine.end()
    return losses, weights, [str(w.message) for w in caught if type(w.message).__name__ == "UnitsNotice"]


def test_zero3_shards_a_model_without_repeated_blocks_by_its_children_and_trains_as_one_process() -> None:
    sharded = run_world(train_rank, 2, 3, timeout=120)
    (single_losses, single_weights, _), *_ = run_world(train_rank, 1, 0, timeout=120)
    _, weights, notices = sharded[0]
    assert notices and "FSDP shards its children (encoder, head) as units" in notices[0]
    losses = [sum(pair) / 2 for pair in zip(sharded[0][0], sharded[1][0], strict=True)]  # (each rank's half)
    assert losses == pytest.approx(single_losses, abs=1e-5)
    for name, tensor in single_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
