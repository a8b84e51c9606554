"""One fine-tune recipe: the config chooses the kind of training (its data and objective), and every kind runs
through the one set-up in `meshkit.recipes.finetune._finetune`. The kinds' numbers are tested against TRL and
transformers in their own modules (test_preference_recipe, test_reward_model, test_process_reward, test_finetune);
each of those runs reads back the `objective` the run recorded."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import meshkit.recipes  # noqa: E402
from tests.helpers.finetune_runs import write_config  # noqa: E402
from tests.helpers.preference_runs import dpo_keys, write_preference_data  # noqa: E402

RECIPES = Path(meshkit.recipes.__file__).parent


def _keys(root: Path, kind: str) -> dict[str, Any]:
    if kind == "sft":
        return {}
    if kind == "reward_model":
        return {
            "reward_model": True, "model_type": "AutoModelForSequenceClassification", "num_labels": 1,
            "datasets": [{"path": str(root / "bt.jsonl"), "type": "bradley_terry.chat_template"}],
        }  # fmt: skip
    if kind == "process_reward_model":
        return {
            "process_reward_model": True, "model_type": "AutoModelForTokenClassification", "num_labels": 2,
            "datasets": [{"path": str(root / "steps.jsonl"), "type": "stepwise_supervised"}],
        }  # fmt: skip
    return dpo_keys(write_preference_data(root), kind)


KINDS = {  # the kind the config asks for: (the class that trains it, the objective's loss)
    "sft": ("SupervisedTraining", None),
    "dpo": ("PreferenceTraining", "DPO"),
    "ipo": ("PreferenceTraining", "DPO"),
    "kto": ("PreferenceTraining", "KTO"),
    "orpo": ("PreferenceTraining", "ORPO"),
    "simpo": ("PreferenceTraining", "CPO"),
    "reward_model": ("PreferenceTraining", "BradleyTerry"),
    "process_reward_model": ("PreferenceTraining", "StepObjective"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_config_chooses_the_kind_and_its_objective(tmp_path, material, kind) -> None:
    from meshkit.recipes.finetune import training_kind
    from meshkit.recipes.finetune_config import resolve_finetune

    config = write_config(tmp_path / "ft.yaml", material, **_keys(tmp_path, kind))
    chosen = training_kind(resolve_finetune(str(config), []))
    expected_class, expected_loss = KINDS[kind]
    assert type(chosen).__name__ == expected_class
    assert chosen.name == kind
    assert type(getattr(chosen, "loss", None)).__name__ == (expected_loss or "NoneType")


def _calls_by_function(path: Path) -> dict[str, set[str]]:
    """{function name: names it calls} of one module (`engine.prepare(...)` counts as `prepare`)."""
    found: dict[str, set[str]] = {}
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Call):
                    callee = node.func
                    name = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
                    found.setdefault(function.name, set()).add(name)
    return found


SET_UP = ("load_base", "adapt", "make_optimizer", "make_schedule", "prepare", "start_adapters", "run_steps")


def test_the_fine_tune_set_up_is_written_once() -> None:
    """Every step of the fine-tune's set-up and its loop is called from one function of recipes/: no kind keeps a
    copy (`meshkit train`, the reference GPT's recipe, has its own model and data and is not a fine-tune)."""
    callers: dict[str, list[str]] = {name: [] for name in SET_UP}
    for path in sorted(RECIPES.glob("*.py")):
        if path.name == "train.py":
            continue
        for function, called in _calls_by_function(path).items():
            for name in SET_UP:
                if name in called:
                    callers[name].append(f"{path.stem}.{function}")
    assert callers == {name: ["finetune._finetune"] for name in SET_UP}
