"""NEFTune (`neftune_noise_alpha`): uniform noise on the input embeddings while training, of the size transformers'
Trainer gives it (the whole row's length under context parallel), none in evaluation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from meshkit import Engine
from meshkit.training.neftune import add_embedding_noise
from tests.helpers.distributed import gloo_world, run_world

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_models import HIDDEN, causal_lm  # noqa: E402

ALPHA, SEQ = 5.0, 16


def test_the_noise_is_transformers_trainers_in_training_and_none_in_evaluation() -> None:
    from transformers.integrations.neftune import neftune_post_forward_hook

    ids = torch.randint(0, 50, (3, SEQ))
    ours, theirs = nn.Embedding(50, 8), nn.Embedding(50, 8)
    theirs.load_state_dict(ours.state_dict())
    add_embedding_noise(ours, ALPHA)
    theirs.neftune_noise_alpha = ALPHA
    theirs.register_forward_hook(neftune_post_forward_hook)
    torch.manual_seed(3)
    want = theirs(ids)
    torch.manual_seed(3)
    got = ours(ids)
    assert torch.equal(got, want)
    clean = nn.functional.embedding(ids, ours.weight)
    bound = ALPHA / math.sqrt(SEQ * 8)
    assert 0.5 * bound < float((got - clean).abs().max()) <= bound
    ours.eval()
    assert torch.equal(ours(ids), clean)


def _embedding_noise(engine: Engine, model: Any, ids: torch.Tensor) -> tuple[float, float]:
    """(largest noise in training, in evaluation) on the prepared model's input embeddings."""
    seen: list[torch.Tensor] = []
    embedding = engine.unwrap_model(model).get_input_embeddings()
    embedding.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    clean = nn.functional.embedding(engine.shard_sequence(ids), embedding.weight.detach())
    with torch.no_grad():
        model.train()
        model(input_ids=engine.shard_sequence(ids))
        model.eval()
        model(input_ids=engine.shard_sequence(ids))
    return float((seen[0] - clean).abs().max()), float((seen[1] - clean).abs().max())


def _noise_under(rank: int, settings: dict[str, Any]) -> tuple[float, float]:
    with gloo_world():
        engine = Engine(seed=0, neftune_noise_alpha=ALPHA, **settings)
        try:
            model = causal_lm("llama")
            model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            return _embedding_noise(engine, model, torch.randint(3, 60, (2, SEQ), generator=torch.Generator()))
        finally:
            engine.end()


@pytest.mark.world
@pytest.mark.parametrize("settings", [{}, {"cp": 2}], ids=["ddp2", "cp2"])
def test_the_engine_adds_noise_of_the_whole_rows_size_in_training_only(settings: dict[str, Any]) -> None:
    bound = ALPHA / math.sqrt(SEQ * HIDDEN)  # (the whole row's length, also where a rank holds half of it)
    for training, evaluation in run_world(_noise_under, 2, settings, timeout=120):
        assert 0.5 * bound < training <= bound * (1 + 1e-6)
        assert evaluation == 0.0
