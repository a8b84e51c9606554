"""Accelerate's example scripts (in their shape: tests/helpers/accelerate_examples.py) run at world 2 with only the
import changed, and give the numbers `accelerate` itself gives: the same learning rates step by step, weights equal
to 1e-5 after training (also with accumulation, local SGD, an fp16 communication hook, a resumed checkpoint and an
executable batch size found after out-of-memory errors), the same metrics, and the files each script writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.accelerate_examples import SCRIPTS, run_topics
from tests.helpers.distributed import run_world

pytestmark = pytest.mark.slow  # side by side with accelerate itself

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def close(found: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], tolerance: float = 1e-5) -> None:
    """Equal to `tolerance` relative, or 1e-6 absolute for entries near zero (the samples are padded and summed in
    another order; Adam's first steps magnify that rounding in the smallest biases)."""
    assert found.keys() == wanted.keys()
    for name, tensor in wanted.items():
        torch.testing.assert_close(found[name], tensor, rtol=tolerance, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("examples")
    topics = list(SCRIPTS)
    results = {
        library: run_world(run_topics, 2, library, topics, str(out), timeout=300)
        for library in ("accelerate", "meshkit")
    }
    return {"out": out, **{library: ranks[0] for library, ranks in results.items()}}


@pytest.mark.parametrize("topic", ["nlp_example", "gradient_accumulation"])
def test_training_and_the_scheduler_equal_accelerate(runs: dict, topic: str) -> None:
    ours, theirs = runs["meshkit"][topic], runs["accelerate"][topic]
    assert ours["lrs"] == pytest.approx(theirs["lrs"])  # a scheduler steps once per process, as Accelerate's
    # each evaluation sample counted once, in the data's order (the references come back as the dataset holds them)
    assert ours["metric"] == theirs["metric"] and ours["metric"]["count"] == 30
    close(ours["weights"], theirs["weights"])


@pytest.mark.parametrize("topic", ["local_sgd", "ddp_comm_hook", "memory"])
def test_helpers_and_handlers_give_accelerates_weights(runs: dict, topic: str) -> None:
    ours, theirs = runs["meshkit"][topic], runs["accelerate"][topic]
    close(ours["weights"], theirs["weights"])
    if topic == "memory":
        assert ours["tried"] == theirs["tried"] == [32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8]
        assert ours["accum"] == theirs["accum"] == 4


def test_a_resumed_run_ends_where_the_straight_run_ends(runs: dict) -> None:
    ours, theirs = runs["meshkit"]["checkpointing"], runs["accelerate"]["checkpointing"]
    close(ours["resumed"], ours["straight"], 1e-6)
    close(ours["straight"], theirs["straight"])
    assert ours["metric_True"] == theirs["metric_True"]


def test_triggers_trackers_profiles_and_optimizer_modes(runs: dict) -> None:
    ours, theirs = runs["meshkit"], runs["accelerate"]
    assert ours["early_stopping"]["stopped_at"] == theirs["early_stopping"]["stopped_at"] == 1
    assert ours["tracking"]["events"] and theirs["tracking"]["events"]
    assert ours["profiler"] == theirs["profiler"] == {"traced": True, "linear": True}
    assert ours["schedule_free"]["modes"] == ["eval", "train"]


def test_the_trained_model_is_saved_by_both_idioms(runs: dict) -> None:
    out, trained = runs["out"] / "meshkit" / "saving", runs["meshkit"]["saving"]["weights"]
    for directory in ("pretrained", "save_model"):
        files = sorted((out / directory).glob("*.safetensors"))
        assert [f.name for f in files] == ["model.safetensors"], directory
        saved = load_file(files[0])
        for name, tensor in saved.items():
            assert torch.equal(tensor, trained[name]), (directory, name)
    assert load_file(out / "extra.safetensors")["step"].item() == 3
