"""Compile and the fused loss together: under DDP (whole model), ZeRO-3 (per block) and tp 2 (per block) a tiny
transformers Llama with the default fused loss compiles without a single graph break — counted by dynamo and read
from the run's own record — and trains as with compile off."""

from __future__ import annotations

from typing import Any

import pytest

from meshkit import Engine
from meshkit.engine.what_ran import what_ran
from tests.helpers.distributed import gloo_world, run_world

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_layouts import batches, build, make_optimizer, rank_part  # noqa: E402

LAYOUTS: dict[str, dict[str, Any]] = {"ddp": {}, "zero3": {"zero_stage": 3}, "tp2": {"tp": 2}}


def _run(layout: str, compiled: bool) -> dict[str, Any]:
    settings = {"enabled": True, "backend": "aot_eager"} if compiled else {}
    engine = Engine(seed=0, compile=settings, **LAYOUTS[layout])
    try:
        model = build("llama")
        model, _ = engine.prepare(model, make_optimizer(model))
        losses = [engine.train_step(rank_part(engine, batch)).item() for batch in batches()]
        ran = what_ran(engine)
        return {"losses": losses, "compile": ran["compile"], "loss": ran["loss"]}
    finally:
        engine.end()


def _every_layout(rank: int) -> dict[str, Any]:
    with gloo_world():
        return {layout: {"on": _run(layout, True), "off": _run(layout, False)} for layout in LAYOUTS}


def test_compile_with_the_fused_loss_has_no_graph_break_in_any_layout() -> None:
    import torch

    torch._dynamo.reset()
    results = run_world(_every_layout, 2, timeout=420)[0]
    for layout, runs in results.items():
        on = runs["on"]
        assert on["loss"].startswith("fused"), (layout, on["loss"])
        assert on["compile"].endswith(", 0 graph breaks") and ": 0 graphs" not in on["compile"], (layout, on["compile"])
        assert on["losses"] == pytest.approx(runs["off"]["losses"], rel=1e-5), layout
    assert results["ddp"]["on"]["compile"].startswith("whole model but its head")
    assert results["zero3"]["on"]["compile"].startswith("per block")
