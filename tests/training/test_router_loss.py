"""The router's balancing loss as train_step takes it: transformers' own definition (padding left out by the
attention mask), and under sequence parallel each tp rank's part of the sequences adds up to the whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshkit.training.router_loss import BalancingLoss

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

BATCH, SEQ, EXPERTS, TOP_K, LAYERS = 3, 8, 6, 2, 3


def routed() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(BATCH * SEQ, EXPERTS, generator=generator) for _ in range(LAYERS))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, 5:], mask[2, 2:] = 0, 0  # right padding
    return logits, mask


def test_the_loss_is_the_models_own_with_padding_left_out() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits, mask = routed()
    loss = BalancingLoss(coefficient=1.0, experts=EXPERTS, top_k=TOP_K, over_global_batch=False)
    count = torch.tensor(7)
    term = loss.term(logits, mask, count, group=None)  # in token-sum units: coefficient × loss × count
    expected = load_balancing_loss_func(logits, EXPERTS, TOP_K, mask)
    torch.testing.assert_close(term / count, expected, rtol=1e-6, atol=0)
    unmasked = load_balancing_loss_func(logits, EXPERTS, TOP_K, None)
    assert abs(float(expected - unmasked)) > 1e-3  # the mask matters here


def test_under_sequence_parallel_each_part_reads_its_part_of_the_mask() -> None:
    """tp rank j's routers see the j-th contiguous part of every sequence: its statistics read the same part of
    the mask, and the parts' statistics add up to the whole's."""
    logits, mask = routed()
    whole = BalancingLoss(1.0, EXPERTS, TOP_K, True)
    full = whole.statistics(logits, mask)
    parts = []
    for shard in range(2):
        part = dataclasses.replace(whole, sequence_shards=2, shard=shard)
        rows = [layer.view(BATCH, SEQ, EXPERTS).chunk(2, dim=1)[shard].reshape(-1, EXPERTS) for layer in logits]
        parts.append(part.statistics(tuple(rows), mask))
    for got, expected in zip(map(sum, zip(*parts, strict=True)), full, strict=True):
        torch.testing.assert_close(got, expected)
