"""`fused_loss`: train_step's causal-LM loss from the head's input and weight, never the whole logits — on where it
is exact (the model returns its head's output as its logits), the same training as from the logits in every layout
(a pipeline's last stage too), and refused in one line where asked for and not possible."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshkit import Engine
from meshkit.core.errors import MeshkitError
from tests.helpers.distributed import gloo_world, run_world

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_layouts import batches, build, make_optimizer, rank_part  # noqa: E402
from tests.helpers.hf_models import causal_lm  # noqa: E402

LAYOUTS = {"ddp2": {}, "tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}, "cp2": {"cp": 2},
           "zero3_2": {"zero_stage": 3}}  # fmt: skip


def _train(family: str, fused: str, **settings: Any) -> dict[str, Any]:
    engine = Engine(seed=0, fused_loss=fused, **settings)
    try:
        model = build(family)
        model, _ = engine.prepare(model, make_optimizer(model))
        pipeline = engine.ctx.objects.pipeline
        used = (engine.ctx.objects.fused_head or getattr(pipeline and pipeline.loss_fn, "fused", None)) is not None
        losses = [engine.train_step(rank_part(engine, batch)).item() for batch in batches()]
        return {"losses": losses, "state": engine.full_state_dict(), "fused": used}
    finally:
        engine.end()


def _close(got: dict[str, Any], want: dict[str, Any], tolerance: float = 1e-6) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=tolerance)
    for name, tensor in want["state"].items():
        scale = float(tensor.abs().max()) or 1.0
        assert float((got["state"][name] - tensor).abs().max()) / scale < tolerance, name


def test_in_one_process_the_fused_loss_trains_like_the_logits_loss() -> None:
    fused, plain = _train("llama", "auto"), _train("llama", "off")
    assert fused["fused"] and not plain["fused"]
    _close(fused, plain)


def test_a_model_that_caps_its_logits_after_the_head_keeps_them_and_on_is_refused_in_one_line() -> None:
    assert not _train("gemma2", "auto")["fused"]  # (gemma2's final soft-cap: logits are not the head's output)
    with pytest.raises(MeshkitError, match="fused_loss=on, but the model changes its head's output on the way") as info:
        _train("gemma2", "on")
    assert "\n" not in str(info.value)


def test_the_eval_forward_of_a_fused_model_returns_its_logits() -> None:
    engine = Engine(seed=0)
    try:
        model = causal_lm("llama")
        ids = torch.randint(3, 60, (2, 8))
        with torch.no_grad():
            want = model(input_ids=ids).logits
        model, _ = engine.prepare(model, make_optimizer(model))
        assert engine.ctx.objects.fused_head is not None
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, want)
    finally:
        engine.end()


def _every_layout(rank: int) -> dict[str, Any]:
    with gloo_world():
        out = {name: {fused: _train("llama", fused, **settings) for fused in ("on", "off")}
               for name, settings in LAYOUTS.items()}  # fmt: skip
        for schedule in ("1f1b", "zbv_zero_bubble"):  # (zero bubble runs the loss's backward twice: input, weights)
            out[schedule] = {fused: _train("llama", fused, pp=2, schedule=schedule) for fused in ("on", "off")}
        return out


@pytest.mark.world
def test_every_layout_trains_alike_with_the_fused_loss_a_pipeline_on_its_last_stage() -> None:
    results = run_world(_every_layout, 2, timeout=300)
    for rank, result in enumerate(results):
        for name in LAYOUTS:
            on, off = result[name]["on"], result[name]["off"]
            assert on["fused"] and not off["fused"], name
            _close(on, off)
        for schedule in ("1f1b", "zbv_zero_bubble"):
            _close(result[schedule]["on"], result[schedule]["off"])
        assert result["1f1b"]["on"]["fused"] is (rank == 1)  # (the last stage's head)
        assert result["zbv_zero_bubble"]["on"]["fused"] is (rank == 0)  # (the V: rank 0 holds stages 0 and 3)
