"""The reference GPT: shapes, causality, RoPE positions, deterministic init, block discovery."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from meshkit.models.blocks import BlockError, find_blocks
from meshkit.models.gpt import GPT, GPTConfig, apply_rope, rope_tables
from tests.helpers.training import TINY, tiny_gpt


def test_shapes_and_causality() -> None:
    model = tiny_gpt()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, TINY.vocab_size)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % TINY.vocab_size
    # a change at position 8 leaves the logits of positions 0..7 untouched
    torch.testing.assert_close(model(changed)[:, :8], logits[:, :8])
    assert not torch.allclose(model(changed)[:, 8:], logits[:, 8:])


def test_explicit_positions_equal_the_default_ones() -> None:
    model = tiny_gpt()
    tokens = torch.randint(0, TINY.vocab_size, (1, 10))
    torch.testing.assert_close(model(tokens, positions=torch.arange(10)), model(tokens))


def test_rope_preserves_norm_and_is_relative() -> None:
    cos, sin = rope_tables(8, 32, 10000.0)
    q = torch.randn(1, 32, 2, 8)
    torch.testing.assert_close(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1))
    a, b = torch.randn(8), torch.randn(8)

    def score(i: int, j: int) -> torch.Tensor:
        qa = apply_rope(a.view(1, 1, 1, 8), cos[i : i + 1], sin[i : i + 1])
        kb = apply_rope(b.view(1, 1, 1, 8), cos[j : j + 1], sin[j : j + 1])
        return (qa * kb).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))  # depends on the distance only


def test_init_is_deterministic_and_meta_init_matches() -> None:
    first, second = tiny_gpt(seed=3), tiny_gpt(seed=3)
    for (name, p), q in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    with torch.device("meta"):
        meta = GPT(TINY)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for name, tensor in first.state_dict().items():
        assert torch.equal(meta.state_dict()[name], tensor), name
    torch.testing.assert_close(meta.rope_cos, first.rope_cos)


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="not divisible by n_heads"):
        GPTConfig(dim=30, n_heads=4)
    with pytest.raises(ValidationError, match="n_kv_heads=3"):
        GPTConfig(dim=32, n_heads=4, n_kv_heads=3)
    assert GPTConfig(dim=96).hidden == 256


def test_find_blocks() -> None:
    model = tiny_gpt()
    name, blocks = find_blocks(model)
    assert name == "layers" and len(blocks) == TINY.n_layers
    assert find_blocks(model, "layers")[1] is blocks
    with pytest.raises(BlockError, match="no nn.ModuleList or nn.Sequential of repeated blocks"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(BlockError, match="has no submodule 'trunk'"):
        find_blocks(tiny_gpt(), "trunk")
