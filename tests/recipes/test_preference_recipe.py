"""`meshkit finetune` with Axolotl's `rl:` keys: DPO and KTO on chat data, LoRA (reference = adapters off) and
full (reference scored once before training), in two ranks equal to one process on the same global batch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, write_config  # noqa: E402
from tests.helpers.preference_runs import dpo_keys, write_preference_data  # noqa: E402

TIMEOUT = 180
EVALUATED = {"val_set_size": 3, "eval_steps": 2}  # 3 held-out records: two ranks hold 2 and 1 (+ a filler)


def run_preference(rank: int, config: str, assignments: list[str]) -> dict:
    from meshkit.recipes.finetune import finetune
    from meshkit.recipes.finetune_config import resolve_finetune

    summary = finetune(resolve_finetune(config, assignments))
    return {key: summary[key] for key in ("losses", "metrics", "reference", "outputs", "layout", "evals", "objective")}


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory):
    return write_preference_data(tmp_path_factory.mktemp("preference-data"))


def _run(tmp_path, material, world: int, name: str, assignments: list[str], **keys) -> dict:
    run_dir = tmp_path / name
    run_dir.mkdir()
    config = write_config(run_dir / "ft.yaml", material, **keys)
    return run_world(run_preference, world, str(config), [f"output_dir={run_dir / 'out'}", *assignments],
                     timeout=TIMEOUT)[0]  # fmt: skip


def _close(got: dict, expected: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6)
    assert len(got["evals"]) == len(expected["evals"])
    for ours, theirs in zip(got["metrics"] + got["evals"], expected["metrics"] + expected["evals"], strict=True):
        for name in (
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "logps/chosen",
            "eval_loss",
            "eval_rewards/margins",
        ):  # noqa: E501
            if name in theirs:
                assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-5), name


@pytest.fixture(scope="module")
def references(tmp_path_factory, material, pair_data):
    """One process on the global batch (4 pairs) of two ranks × 2: DPO with LoRA and full, KTO with LoRA."""
    root = tmp_path_factory.mktemp("preference-reference")
    return {
        "lora": _run(
            root, material, 1, "lora", ["micro_batch_size=4"], **dpo_keys(pair_data), **lora_keys(), **EVALUATED
        ),
        "full": _run(root, material, 1, "full", ["micro_batch_size=4"], **dpo_keys(pair_data), **EVALUATED),
        "precomputed": _run(
            root,
            material,
            1,
            "precomputed",
            ["micro_batch_size=4"],
            **dpo_keys(pair_data),
            **EVALUATED,
            precompute_ref_log_probs=True,
        ),
        "kto": _run(
            root, material, 1, "kto", ["micro_batch_size=4"], **dpo_keys(pair_data, "kto"), **lora_keys(), **EVALUATED
        ),
    }


def test_dpo_learns_to_prefer_the_chosen_replies(references) -> None:
    lora, full = references["lora"], references["full"]
    assert lora["objective"] == full["objective"] == "dpo" and references["kto"]["objective"] == "kto"
    assert lora["reference"] == "the base with adapters off"
    assert full["reference"] == "a frozen copy laid out like the policy"
    assert references["precomputed"]["reference"].startswith("precomputed reference log-probs")
    _close(references["precomputed"], full)  # the same numbers without a second model
    for run in (lora, full):
        first, last = run["metrics"][0], run["metrics"][-1]
        assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
        assert run["losses"][0] == pytest.approx(0.6931472, abs=1e-6)  # -log σ(0)
        assert last["rewards/margins"] > 0 and run["losses"][-1] < run["losses"][0]
    assert references["kto"]["metrics"][-1]["rewards/chosen"] > references["kto"]["metrics"][0]["rewards/chosen"]
    evals = lora["evals"]
    assert [e["step"] for e in evals] == [2, 4] and evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"]


# (LoRA under DDP: KTO's and RPO's tests; LoRA and full meet tp, cp and pp below)
@pytest.mark.parametrize(("adapter", "zero_stage"), [("lora", 3), ("full", 0), ("full", 3), ("precomputed", 3)])
def test_two_ranks_equal_one_process(tmp_path, material, pair_data, references, adapter, zero_stage) -> None:
    keys = {**dpo_keys(pair_data), **(lora_keys() if adapter == "lora" else {})}
    keys |= EVALUATED  # (a precomputed reference scores the held-out records before training too)
    if adapter == "precomputed":
        keys["precompute_ref_log_probs"] = True
    summary = _run(tmp_path, material, 2, "run", [f"zero_stage={zero_stage}"], **keys)
    _close(summary, references[adapter])


@pytest.mark.parametrize(
    ("layout", "adapter"), [("tp=2", "lora"), ("tp=2", "full"), ("cp=2", "lora"), ("pp=2", "lora"), ("pp=2", "full")]
)
def test_model_parallel_equals_one_process(tmp_path, material, pair_data, references, layout, adapter) -> None:
    # dp = 1: each rank holds the whole global batch of 4 pairs, as the reference did
    keys = {**dpo_keys(pair_data), **EVALUATED, **(lora_keys() if adapter == "lora" else {})}
    summary = _run(tmp_path, material, 2, "run", [layout, "micro_batch_size=4"], **keys)
    _close(summary, references[adapter])


def test_kto_two_ranks_equal_one_process(tmp_path, material, pair_data, references) -> None:
    summary = _run(tmp_path, material, 2, "run", [], **dpo_keys(pair_data, "kto"), **lora_keys(), **EVALUATED)
    _close(summary, references["kto"])


@pytest.mark.parametrize("method", ["kto", "orpo", "simpo"])
def test_kto_and_orpo_under_pipeline_parallel_equal_one_process(tmp_path, material, pair_data, references, method):
    """KTO's KL rows, ORPO's whole-row NLL and SimPO's completion NLL reach the last stage as extras and targets;
    the NLL terms are token means over the whole micro-step, whatever the micro-batches."""
    keys = {**dpo_keys(pair_data, method), **lora_keys(), **(EVALUATED if method == "kto" else {})}
    expected = (
        references[method]
        if method in references
        else _run(tmp_path, material, 1, "one", ["micro_batch_size=4"], **keys)
    )  # noqa: E501
    summary = _run(tmp_path, material, 2, "run", ["pp=2", "micro_batch_size=4"], **keys)
    _close(summary, expected)
    assert summary["losses"][-1] < summary["losses"][0] and summary["objective"] == method


def test_rpo_nll_term_is_a_token_mean_over_every_rank(tmp_path, material, pair_data) -> None:
    """DPO + rpo_alpha: the chosen replies' NLL is a mean over every rank's tokens, so two ranks equal one."""
    keys = {**dpo_keys(pair_data), **lora_keys(), "rpo_alpha": 1.0}
    expected = _run(tmp_path, material, 1, "one", ["micro_batch_size=4"], **keys)
    _close(_run(tmp_path, material, 2, "two", [], **keys), expected)  # (DDP)


@pytest.fixture(scope="module")
def wpo_reference(tmp_path_factory, material, pair_data):
    root = tmp_path_factory.mktemp("wpo-reference")
    keys = {**dpo_keys(pair_data), **lora_keys(), **EVALUATED, "dpo_use_weighting": True}
    return keys, _run(root, material, 1, "one", ["micro_batch_size=4"], **keys)


@pytest.mark.parametrize("layout", ["tp=2", "pp=2", pytest.param("cp=2", marks=pytest.mark.sweep)])
def test_wpo_weights_are_the_same_in_every_layout(tmp_path, material, wpo_reference, references, layout) -> None:
    """WPO's weights (log Σp² over the vocabulary: reduced over tp's vocabulary slices, cp's chunks, on pp's last
    stage) weigh each pair alike in every layout; they change the run (a pair's weight is below 1)."""
    keys, expected = wpo_reference
    summary = _run(tmp_path, material, 2, "run", [layout, "micro_batch_size=4"], **keys)
    _close(summary, expected)
    assert abs(expected["losses"][0] - references["lora"]["losses"][0]) > 1e-4
