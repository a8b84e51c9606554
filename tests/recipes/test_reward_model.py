"""`reward_model: true`: a Bradley–Terry reward model equal to TRL's RewardTrainer, two ranks equal to one, and
an export that scores pairs with `from_pretrained` as in training."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("trl", reason="TRL (a test dependency) is not installed")

from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.preference_runs import (  # noqa: E402
    LR,
    MAX_GRAD_NORM,
    STEPS,
    bradley_terry_records,
    make_reward_base,
    trl_reward_metrics,
)

TIMEOUT = 180


def run_reward(rank: int, config: str, assignments: list[str]) -> dict:
    from meshkit.recipes.finetune import finetune
    from meshkit.recipes.finetune_config import resolve_finetune

    summary = finetune(resolve_finetune(config, assignments))
    return {key: summary[key] for key in ("losses", "metrics", "outputs")}


@pytest.fixture(scope="module")
def reward_base(tmp_path_factory):
    return make_reward_base(tmp_path_factory.mktemp("reward-base"))


def _config(tmp_path, base, records, **keys):
    data = tmp_path / "bt.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {
        "base_model": str(base), "model_type": "AutoModelForSequenceClassification", "num_labels": 1,
        "reward_model": True, "chat_template": "tokenizer_default", "attn_implementation": "eager",
        "datasets": [{"path": str(data), "type": "bradley_terry.chat_template"}], "sequence_len": 64,
        "micro_batch_size": len(records), "max_steps": STEPS, "learning_rate": LR, "lr_scheduler": "constant",
        "optimizer": "sgd", "max_grad_norm": MAX_GRAD_NORM, "weight_decay": 0.0, "output_dir": str(tmp_path / "out"),
        "generation_samples": 0, **keys,
    }  # fmt: skip
    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_bradley_terry_equals_trl_reward_trainer_and_the_export_scores_alike(tmp_path, reward_base) -> None:
    records = bradley_terry_records()
    theirs = trl_reward_metrics(reward_base, tmp_path / "trl", records)
    ours = run_world(run_reward, 1, _config(tmp_path, reward_base, records), [], timeout=TIMEOUT)[0]
    assert len(theirs) == len(ours["losses"]) == STEPS
    for step, (their, loss, metrics) in enumerate(zip(theirs, ours["losses"], ours["metrics"], strict=True)):
        assert loss == pytest.approx(their["loss"], rel=1e-5, abs=1e-6), step
        for name in ("accuracy", "margin", "mean_reward"):
            assert metrics[name] == pytest.approx(their[name], rel=1e-5, abs=1e-6), (step, name)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    merged = ours["outputs"]["merged"]
    model = AutoModelForSequenceClassification.from_pretrained(merged).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r[side]}], tokenize=False
        )
        for r in records
        for side in ("chosen", "rejected")
    ]
    batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        rewards = model(**batch).logits.squeeze(-1)
    chosen, rejected = rewards[0::2], rewards[1::2]
    assert model.config.num_labels == 1 and bool((chosen > rejected).float().mean() >= 0.5)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_two_ranks_equal_one_process(tmp_path, reward_base, zero_stage) -> None:
    records = bradley_terry_records(8)
    (tmp_path / "one").mkdir()
    one = run_world(run_reward, 1, _config(tmp_path / "one", reward_base, records), [], timeout=TIMEOUT)[0]
    two = run_world(
        run_reward, 2, _config(tmp_path, reward_base, records, micro_batch_size=4), [f"zero_stage={zero_stage}"],
        timeout=TIMEOUT,
    )[0]  # fmt: skip
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert two["metrics"][-1]["accuracy"] == pytest.approx(one["metrics"][-1]["accuracy"])


SWEEP = pytest.mark.sweep  # (`make test-full`: the same mechanism as a layout the default suite runs)


@pytest.mark.parametrize("layout", [pytest.param("tp=2", marks=SWEEP), "cp=2", "pp=2"])
def test_model_parallel_equals_one_process(tmp_path, reward_base, layout) -> None:
    records = bradley_terry_records(8)
    (tmp_path / "one").mkdir()
    one = run_world(run_reward, 1, _config(tmp_path / "one", reward_base, records), [], timeout=TIMEOUT)[0]
    two = run_world(run_reward, 2, _config(tmp_path, reward_base, records), [layout], timeout=TIMEOUT)[0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)


LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]}


def test_a_lora_reward_model_equals_trl_with_the_same_adapter_and_exports_its_head(tmp_path, reward_base) -> None:
    """LoRA over the base with the new head trained whole (peft's SEQ_CLS task saves it with the adapter), equal to
    TRL's RewardTrainer given the same peft model; the adapter loads over the base and scores as merged/ does."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    records = bradley_terry_records()
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    theirs = trl_reward_metrics(reward_base, tmp_path / "trl", records, lora=lora)
    ours = run_world(run_reward, 1, _config(tmp_path, reward_base, records, **LORA), [], timeout=TIMEOUT)[0]
    for step, (their, loss) in enumerate(zip(theirs, ours["losses"], strict=True)):
        assert loss == pytest.approx(their["loss"], rel=1e-5, abs=1e-6), step
    assert ours["losses"][-1] < ours["losses"][0]
    tokenizer = AutoTokenizer.from_pretrained(ours["outputs"]["merged"])
    texts = [f"Shout {word}" for word in ("apple", "river", "stone")]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    merged = AutoModelForSequenceClassification.from_pretrained(ours["outputs"]["merged"]).eval()
    adapter = AutoPeftModelForSequenceClassification.from_pretrained(ours["outputs"]["adapter"]).eval()
    base = AutoModelForSequenceClassification.from_pretrained(reward_base).eval()
    with torch.no_grad():
        merged_scores, adapter_scores = merged(**batch).logits, adapter(**batch).logits
        base_scores = base(**batch).logits
    torch.testing.assert_close(adapter_scores, merged_scores, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(base_scores, merged_scores)  # (the head and adapters trained)


@pytest.mark.parametrize(
    "layout", [pytest.param("zero_stage=3", marks=SWEEP), pytest.param("tp=2", marks=SWEEP), "pp=2"]
)
def test_a_lora_reward_model_on_two_ranks_equals_one_process(tmp_path, reward_base, layout) -> None:
    records = bradley_terry_records(8)
    (tmp_path / "one").mkdir()
    one = run_world(run_reward, 1, _config(tmp_path / "one", reward_base, records, **LORA), [], timeout=TIMEOUT)[0]
    halves = {"micro_batch_size": 4} if layout.startswith("zero") else {}  # (data parallel: half the pairs a rank)
    config = _config(tmp_path, reward_base, records, **LORA, **halves)
    two = run_world(run_reward, 2, config, [layout], timeout=TIMEOUT)[0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
