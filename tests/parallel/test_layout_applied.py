"""A layout that was asked for is in effect, read back from the prepared model: tp 2 that splits no layer stops in
one line (it would train an unsplit model on every rank, with losses equal to one process), and where it splits,
the run's record shows each rank's share of the split layers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshkit import Engine
from meshkit.core.errors import MeshkitError
from meshkit.engine.what_ran import what_ran
from tests.helpers.distributed import gloo_world, run_world

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_models import causal_lm  # noqa: E402


def _mamba() -> Any:
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2)
    return transformers.MambaForCausalLM(config)


def _prepare(model: Any) -> dict[str, Any]:
    engine = Engine(seed=0, tp=2)
    try:
        try:
            engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except MeshkitError as error:
            return {"refused": str(error)}
        return {"parameters": what_ran(engine)["parameters"][0]}
    finally:
        engine.end()


def _sequence_seen(**layout: Any) -> str | None:
    engine = Engine(seed=0, **layout)
    try:
        model = causal_lm("llama")
        model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(0))
        engine.train_step({"input_ids": ids, "labels": ids})
        return what_ran(engine).get("sequence")
    finally:
        engine.end()


def _both(rank: int) -> dict[str, Any]:
    with gloo_world():
        return {
            "mamba": _prepare(_mamba()),
            "llama": _prepare(causal_lm("llama")),
            "sequence": {name: _sequence_seen(**layout) for name, layout in SEQUENCE_LAYOUTS.items()},
        }


SEQUENCE_LAYOUTS: dict[str, dict[str, Any]] = {"tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True},
                                               "cp2": {"cp": 2}}  # fmt: skip


def test_tp_that_splits_nothing_stops_in_one_line_and_a_split_shows_in_the_record_with_the_sequence_seen() -> None:
    results = run_world(_both, 2, timeout=180)
    for rank in results:
        refused = rank["mamba"].get("refused", "")
        assert "tp=2 split no layer of" in refused and "use tp=1" in refused and "\n" not in refused
        held = rank["llama"]["parameters"]
        assert held["tp_held"] * 2 == held["tp_split"]  # each rank holds half of every split layer
        assert held["tp_split"] > 0.5 * held["whole"] and held["held"] < held["whole"]
        seen = rank["sequence"]
        assert seen["tp2"] == "16 of 16 tokens per row in the blocks"  # (tp without SP: every rank the whole row)
        assert seen["tp2_sp"] == seen["cp2"] == "8 of 16 tokens per row in the blocks"
