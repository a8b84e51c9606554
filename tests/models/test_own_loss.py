"""How a causal LM's own loss reads its labels (`models/own_loss.py`), and the engine training it as written:
shifted inside (transformers' usual), taken already shifted (CpmAnt), or a loss of the model's own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshkit import Engine
from meshkit.core.errors import MeshkitError
from meshkit.models.own_loss import own_loss
from meshkit.models.structure import describe
from tests.helpers.distributed import gloo_world, run_world

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_models import causal_lm, config  # noqa: E402


def _cpmant() -> Any:
    settings = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64, num_hidden_layers=2,
                    dropout_p=0.0, init_std=0.02)  # fmt: skip
    torch.manual_seed(0)
    return transformers.CpmAntForCausalLM(transformers.CpmAntConfig(**settings))


class ZLossLlama(transformers.LlamaForCausalLM):
    """A causal LM whose own loss adds a term of its own (a z-loss on the logits)."""

    def forward(self, input_ids: Any = None, position_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        output = super().forward(input_ids=input_ids, position_ids=position_ids, labels=labels, **kwargs)
        if output.loss is not None:
            output.loss = output.loss + 1e-2 * output.logits.float().logsumexp(-1).pow(2).mean()
        return output


def _z_loss_llama() -> Any:
    torch.manual_seed(0)
    return ZLossLlama(config("llama"))


def _batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 64, (2, 12), generator=generator) for _ in range(3)]
    return [{"input_ids": batch, "labels": batch.clone()} for batch in ids]


def _plain_losses(model: Any) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in _batches():
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _engine_losses(model: Any, **settings: Any) -> list[float]:
    engine = Engine(seed=0, **settings)
    try:
        model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return [engine.train_step(batch).item() for batch in _batches()]
    finally:
        engine.end()


def test_the_labels_shift_is_learnt_from_one_forward() -> None:
    llama = causal_lm("llama")
    assert own_loss(llama, describe(llama)).shift == 1  # type: ignore[union-attr]
    cpmant = _cpmant()  # (its embedding has prompt rows beyond the head's vocabulary)
    assert own_loss(cpmant, describe(cpmant)).shift == 0  # type: ignore[union-attr]
    z_loss = _z_loss_llama()
    learnt = own_loss(z_loss, describe(z_loss))
    assert learnt is not None and learnt.shift is None and learnt.own > learnt.next_token
    with torch.device("meta"):
        on_meta = transformers.LlamaForCausalLM(config("llama"))
    assert own_loss(on_meta, describe(on_meta)) is None  # (nothing to learn from without values)


@pytest.mark.parametrize("build", [_cpmant, _z_loss_llama], ids=["labels-already-shifted", "a-loss-of-its-own"])
def test_the_engine_trains_the_model_as_its_own_loss_is_written(build: Any, capsys: Any) -> None:
    want = _plain_losses(build())
    got = _engine_losses(build())
    assert got == pytest.approx(want, rel=1e-5)
    if build is _z_loss_llama:
        assert "own loss is not the next-token cross-entropy of its logits" in capsys.readouterr().out


def _under_context_parallel(rank: int) -> str:
    with gloo_world():
        try:
            _engine_losses(_z_loss_llama(), cp=2)
        except MeshkitError as error:
            return str(error)
    return "trained"


def test_a_loss_of_its_own_is_refused_in_one_line_where_meshkit_must_compute_it() -> None:
    messages = run_world(_under_context_parallel, 2, timeout=120)
    assert all("context parallel needs meshkit to compute it from the logits: pass loss_fn=" in m for m in messages)
    assert all("\n" not in message for message in messages)
