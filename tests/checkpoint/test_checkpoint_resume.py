"""save_state / load_state: round trips for each strategy, and resharding to another layout and world size.

Every case trains STEPS steps saving after HALF of them, then a new run loads that checkpoint (at the same or
another layout) and trains the rest: its losses, learning rate and final weights must match the first run's.
The runs share a few worlds (one per world size and phase) to keep start-up costs down.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpointing import STEPS, saved_files, train_jobs
from tests.helpers.distributed import run_world
from tests.helpers.training import assert_close_relative, assert_state_close

HALF = STEPS // 2
PP2 = {"pp": 2, "dp_replicate": 1, "pipeline": {"microbatches": 2}}

# name -> (world, model kind, layout) of the run that saves
SAVED = {
    "ddp": (2, "gpt", {}),
    "zero1": (2, "gpt", {"zero_stage": 1}),
    "zero2": (2, "gpt", {"zero_stage": 2}),
    "zero3": (2, "gpt", {"zero_stage": 3}),
    "tp": (2, "gpt", {"tp": 2, "dp_replicate": 1}),
    "cp": (2, "gpt", {"cp": 2, "dp_replicate": 1}),
    "pp": (2, "gpt", PP2),
    "tp_fused_qkv": (2, "gpt2", {"tp": 2, "dp_replicate": 1}),
    "zero3_async": (2, "gpt", {"zero_stage": 3}),
    "hsdp": (4, "gpt", {"zero_stage": 3, "dp_replicate": 2, "dp_shard": 2}),
    "zero3_w4": (4, "gpt", {"zero_stage": 3}),
    "dp2_tp2": (4, "gpt", {"tp": 2, "dp_replicate": 2}),
    "zero1_tp2": (4, "gpt", {"tp": 2, "zero_stage": 1}),
}
# name -> (saved checkpoint, world, layout of the run that loads, tolerance)
# Across layouts the tolerance is the layout-equivalence tests' (another reduction order).
RESUMED = {
    **{name: (name, 2, SAVED[name][2], 1e-5) for name in ("ddp", "zero1", "zero2", "zero3", "tp", "cp", "pp")},
    "hsdp": ("hsdp", 4, SAVED["hsdp"][2], 1e-5),
    "zero3_w4_as_ddp_w2": ("zero3_w4", 2, {}, 1e-5),
    "dp2_tp2_as_one_process": ("dp2_tp2", 1, {}, 1e-5),
    "fused_qkv_tp2_as_one_process": ("tp_fused_qkv", 1, {}, 1e-4),
    "pp2_as_pp1": ("pp", 1, {}, 1e-5),
    "zero1_as_ddp": ("zero1", 2, {}, 1e-5),
    "zero1_tp2": ("zero1_tp2", 4, SAVED["zero1_tp2"][2], 1e-5),
    "dp2_tp2_as_zero2_tp2": ("dp2_tp2", 4, {"tp": 2, "zero_stage": 2}, 1e-5),
    "ddp_as_zero2": ("ddp", 2, {"zero_stage": 2}, 1e-5),
    "zero3_sync_as_one_process": ("zero3", 1, {}, 1e-5),
    "zero3_async_as_one_process": ("zero3_async", 1, {}, 1e-5),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("checkpoints")
    out: dict[str, dict] = {"saved": {}, "resumed": {}, "root": root}
    for world in (2, 4):
        jobs = {
            name: (
                layout,
                {"kind": kind, "save_at": HALF, "save_to": str(root / name), "asynchronous": "async" in name},
            )
            for name, (w, kind, layout) in SAVED.items()
            if w == world
        }
        out["saved"].update(run_world(train_jobs, world, jobs, timeout=400)[0])
    for world in (1, 2, 4):
        jobs = {
            name: (layout, {"kind": SAVED[source][1], "first": HALF, "load_from": str(root / source)})
            for name, (source, w, layout, _) in RESUMED.items()
            if w == world
        }
        results = run_world(train_jobs, world, jobs, timeout=400)
        out["resumed"].update({name: [rank[name] for rank in results] for name in jobs})
    return out


@pytest.mark.parametrize("name", list(RESUMED))
def test_a_resumed_run_continues_exactly_like_the_uninterrupted_one(runs, name: str) -> None:
    source, _, _, tol = RESUMED[name]
    whole = runs["saved"][source]
    assert {"manifest.json", "meta.json"} <= set(saved_files(str(Path(runs["root"]) / source)))
    for result in runs["resumed"][name]:  # every rank
        assert_close_relative(result["losses"], whole["losses"][HALF:], tol)
        assert_state_close(result["state"], whole["state"], tol)
        assert result["lr"] == pytest.approx(whole["lr"])


def test_an_async_save_holds_the_same_state_as_a_sync_save(runs) -> None:
    from_sync = runs["resumed"]["zero3_sync_as_one_process"][0]
    from_async = runs["resumed"]["zero3_async_as_one_process"][0]
    assert from_sync["losses"] == from_async["losses"]
    assert_state_close(from_async["state"], from_sync["state"], 0.0)


def test_zero_states_saved_under_tensor_parallel_refuse_another_layout(runs) -> None:
    from meshkit import Engine
    from meshkit.checkpoint.storage import CheckpointError
    from tests.helpers.checkpointing import adamw, build

    with Engine(seed=0) as engine:
        model = build("gpt")
        engine.prepare(model, adamw(model))
        with pytest.raises(CheckpointError, match="saved by ZeRO-1/2 with tp=2, ep=1 .* this run is not ZeRO-1/2"):
            engine.load_state(str(Path(runs["root"]) / "zero1_tp2"))
