"""Sequence parallel on a per-token module that takes two inputs shaped alike (Ergo's residual gate: the branch and
the residual): both run as this rank's sequence shard — torch's own SequenceParallel hands the module its first
input only — and the weight's gradient is the whole sequence's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from meshkit.parallel.tensor.sequence import EveryInputSequenceParallel
from tests.helpers.distributed import gloo_world, run_world


class ResidualGate(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, width))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        gate = self.weight.sigmoid()
        return gate * hidden + (1 - gate) * residual


def _shard_run(rank: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import parallelize_module

    generator = torch.Generator().manual_seed(0)
    hidden, residual = (torch.randn(2, 8, 4, generator=generator) for _ in range(2))
    with gloo_world():
        gate = ResidualGate(4)
        parallelize_module(gate, init_device_mesh("cpu", (2,)), EveryInputSequenceParallel(use_local_output=True))
        part = slice(rank * 4, (rank + 1) * 4)
        out = gate(hidden[:, part], residual[:, part])
        out.pow(2).sum().backward()
        grad = gate.weight.grad.full_tensor() if hasattr(gate.weight.grad, "full_tensor") else gate.weight.grad
        return {"out": out.detach(), "grad": grad.detach()}


def test_a_two_input_per_token_module_runs_on_sequence_shards_with_the_whole_gradient() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden, residual = (torch.randn(2, 8, 4, generator=generator) for _ in range(2))
    whole = ResidualGate(4)
    want = whole(hidden, residual)
    want.pow(2).sum().backward()
    results = run_world(_shard_run, 2, timeout=120)
    got = torch.cat([result["out"] for result in results], dim=1)
    torch.testing.assert_close(got, want.detach())
    for result in results:
        torch.testing.assert_close(result["grad"], whole.weight.grad)
