"""Ring attention equals full attention (output and q/k/v gradients, fp32, <= 1e-5) at cp = 2 and 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshkit.parallel.context.apply import shard_sequence
from meshkit.parallel.context.ring_attention import ring_attention
from tests.helpers.distributed import run_world

BATCH, HEADS, SEQ, DIM = 2, 3, 16, 8


def full_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator) for _ in range(4))
    return q, k, v, grad


def ring_rank(rank: int, causal: bool) -> dict:
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    q, k, v, grad = (shard_sequence(t, cp, rank, dim=2) for t in full_inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, dist.group.WORLD, causal=causal)
    out.backward(grad)
    dist.destroy_process_group()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_full_attention(cp: int, causal: bool) -> None:
    q, k, v, grad = full_inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    expected.backward(grad)
    reference = {"out": expected.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for rank, result in enumerate(run_world(ring_rank, cp, causal, timeout=120)):
        for name, tensor in result.items():
            local = shard_sequence(reference[name], cp, rank, dim=2)
            torch.testing.assert_close(tensor, local, rtol=1e-5, atol=1e-5, msg=f"{name} on rank {rank}")
