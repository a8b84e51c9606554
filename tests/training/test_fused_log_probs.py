"""Each token's log-probability from the hidden states and the head weight a chunk at a time
(`training/fused_log_probs.py`): the values, WPO's log Σp², and the gradients of any weighting of them equal those
of the whole logits, with and without a bias, across chunk boundaries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshkit.training.fused_log_probs import fused_token_log_probs


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_log_probs_and_their_gradients_equal_the_whole_logits(bias: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    offset = torch.randn(50, generator=generator, dtype=torch.float64, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (3, 7), generator=generator)
    targets[0, :2] = -100  # (not counted: log-prob 0, no gradient)
    upstream = torch.randn(3, 7, generator=generator, dtype=torch.float64)  # (DPO weighs every row its own way)
    got, squares = fused_token_log_probs(hidden, weight, targets, offset, chunk_bytes=4 * 50 * 2, with_squares=True)
    logits = F.linear(hidden, weight, offset).float()
    flat = logits.flatten(0, 1)
    want = -F.cross_entropy(flat, targets.flatten(), ignore_index=-100, reduction="none").view(3, 7)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want_squares = (torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1)).detach()
    torch.testing.assert_close(squares, want_squares, atol=1e-5, rtol=1e-5)
    inputs = [hidden, weight] + ([offset] if offset is not None else [])
    mine = torch.autograd.grad((got * upstream).sum(), inputs)
    theirs = torch.autograd.grad((want * upstream).sum(), inputs)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert float(got[0, :2].abs().sum()) == 0.0
