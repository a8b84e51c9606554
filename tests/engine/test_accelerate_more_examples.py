"""The rest of Accelerate's CPU-runnable examples in their shape (tests/helpers/accelerate_more_examples.py), at
world 2 with only the import changed, against `accelerate` itself: cross-validation (the test logits averaged over
folds, an unprepared test loader gathered whole), the image classifier with a frozen backbone and OneCycleLR (its
per-process stepping stops at the schedule's end), its resumed form, and the autoregressive token-weighted
accumulation through DDP's own no_sync."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.accelerate_more_examples import SCRIPTS, run_more_topics
from tests.helpers.distributed import run_world

pytestmark = pytest.mark.slow  # side by side with accelerate itself

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def close(found: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> None:
    assert found.keys() == wanted.keys()
    for name, tensor in wanted.items():
        torch.testing.assert_close(found[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = str(tmp_path_factory.mktemp("more"))
    return {
        lib: run_world(run_more_topics, 2, lib, list(SCRIPTS), out, timeout=300)[0] for lib in ("accelerate", "meshkit")
    }


def test_cross_validation_averages_the_folds_as_accelerate_does(runs: dict) -> None:
    ours, theirs = runs["meshkit"]["cross_validation"], runs["accelerate"]["cross_validation"]
    close(ours["logits"], theirs["logits"])
    assert ours["references"] == theirs["references"] and len(ours["references"]) == 40  # 20 per process, whole


def test_the_image_classifier_and_its_resumed_form(runs: dict) -> None:
    ours, theirs = runs["meshkit"], runs["accelerate"]
    assert ours["cv_example"]["lrs"] == pytest.approx(theirs["cv_example"]["lrs"])  # OneCycleLR, stepped per process
    assert ours["cv_example"]["metrics"] == theirs["cv_example"]["metrics"]
    close(ours["cv_example"]["weights"], theirs["cv_example"]["weights"])
    close(ours["complete_cv_example"]["resumed"], ours["complete_cv_example"]["straight"])
    close(ours["complete_cv_example"]["straight"], theirs["complete_cv_example"]["straight"])


def test_token_weighted_accumulation_of_a_causal_lm(runs: dict) -> None:
    ours, theirs = runs["meshkit"]["autoregressive"], runs["accelerate"]["autoregressive"]
    assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-5)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
    assert ours["perplexity"] == pytest.approx(theirs["perplexity"], rel=1e-5)
    close(ours["weights"], theirs["weights"])


@pytest.mark.world
def test_the_examples_evaluation_is_the_same_beside_a_cpu_bound_process(runs: dict, tmp_path) -> None:
    """The autoregressive example's perplexity (gathered per evaluation batch, its padding cut) once depended on
    timing on a busy host: run again twice while another process keeps a core busy, every number is the same."""
    import multiprocessing

    busy = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    busy.start()
    try:
        again = [run_world(run_more_topics, 2, "meshkit", ["autoregressive"], str(tmp_path / str(i)), timeout=300)
                 for i in range(2)]  # fmt: skip
    finally:
        busy.terminate()
    wanted = runs["accelerate"]["autoregressive"]
    for ranks in again:
        for rank in ranks:  # (every rank's own result: what is cut is agreed across ranks)
            assert rank["autoregressive"]["perplexity"] == pytest.approx(wanted["perplexity"], rel=1e-5)
            assert rank["autoregressive"]["losses"] == pytest.approx(wanted["losses"], rel=1e-5)


def _spin() -> None:
    while True:
        pass
