"""`process_reward_model: true` on `stepwise_supervised` data: rows tokenized as Axolotl's strategy does (a step's
label on its last token), a loss equal to transformers' token-classification loss in a plain loop, two ranks equal
to one, and an export that scores the held-out rows with `from_pretrained` as the run's last evaluation did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.jsonl import DataFormatError  # noqa: E402
from meshkit.data.stepwise import StepCollate, tokenize_steps  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402

TIMEOUT = 180
STEPS, LR, MAX_GRAD_NORM, SEED = 3, 0.5, 1.0, 7


def stepwise_records(count: int, offset: int = 0) -> list[dict]:
    records = []
    for i in range(offset, offset + count):
        a, b = i % 7 + 1, i % 5 + 2
        total = a + b if i % 3 else a + b + 1  # every third record ends on a wrong step
        steps = [f"{a} plus {b}", f"makes {total}"]
        records.append({"prompt": f"Add {a} and {b}.", "completions": steps, "labels": [True, total == a + b]})
    return records


def run_prm(rank: int, config: str, assignments: tuple[str, ...] = ()) -> dict:
    from meshkit.recipes.finetune import finetune
    from meshkit.recipes.finetune_config import resolve_finetune

    summary = finetune(resolve_finetune(config, list(assignments)))
    return {key: summary[key] for key in ("losses", "metrics", "outputs", "evals", "rl", "objective")}


@pytest.fixture(scope="module")
def prm_base(material, tmp_path_factory) -> Path:
    """The tiny base with a two-label token-classification head (seeded, saved with it: both sides start alike),
    without the head's dropout (two runs would draw different masks)."""
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(material["base"], num_labels=2)
    config.classifier_dropout = 0.0
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(material["base"], config=config)
    out = tmp_path_factory.mktemp("prm-base")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(material["base"]).save_pretrained(out)
    return out


def _config(folder: Path, base: Path, train: list[dict], test: list[dict], **keys) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for name, records in (("train", train), ("test", test)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {
        "base_model": str(base), "model_type": "AutoModelForTokenClassification", "num_labels": 2,
        "process_reward_model": True, "attn_implementation": "eager",
        "datasets": [{"path": str(folder / "train.jsonl"), "type": "stepwise_supervised", "step_separator": "\n"}],
        "test_datasets": [{"path": str(folder / "test.jsonl"), "type": "stepwise_supervised"}],
        "sequence_len": 64, "micro_batch_size": len(train), "max_steps": STEPS, "learning_rate": LR,
        "lr_scheduler": "constant", "optimizer": "sgd", "max_grad_norm": MAX_GRAD_NORM, "weight_decay": 0.0,
        "seed": SEED, "output_dir": str(folder / "out"), "generation_samples": 0, **keys,
    }  # fmt: skip
    path = folder / "prm.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _rows(tokenizer, records: list[dict]) -> dict[str, torch.Tensor]:
    entry = DatasetEntry(path="x", type="stepwise_supervised")
    return StepCollate(tokenizer.pad_token_id)([tokenize_steps(r, tokenizer, entry, 64) for r in records])


def test_a_steps_label_sits_on_its_last_token_as_axolotl_puts_it(tokenizer) -> None:
    record = {"prompt": "Add 2 and 3.", "completions": ["2 plus 3", "makes 6"], "labels": [True, False]}
    entry = DatasetEntry(path="x", type="stepwise_supervised", step_separator="\n")
    row = tokenize_steps(record, tokenizer, entry, 64)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    separator = tokenizer.encode("\n", add_special_tokens=False)
    first, second = encode("2 plus 3") + separator, encode("makes 6") + separator
    prompt = [tokenizer.bos_token_id, *encode("Add 2 and 3.")]
    assert row["input_ids"] == prompt + first + second
    assert row["labels"] == [-100] * (len(prompt) + len(first) - 1) + [1] + [-100] * (len(second) - 1) + [0]
    last_only = tokenize_steps(record, tokenizer, entry.model_copy(update={"train_on_last_step_only": True}), 64)
    assert [label for label in last_only["labels"] if label != -100] == [0]
    cut = tokenize_steps(record, tokenizer, entry, 5)
    assert len(cut["input_ids"]) == 5 and cut["cut"]
    with pytest.raises(DataFormatError, match="data.jsonl:3: 2 completions \\(steps\\) but 1 labels"):
        tokenize_steps({**record, "labels": [True]}, tokenizer, entry, 64, "data.jsonl:3")


def test_the_loss_is_transformers_token_classification_loss_and_the_export_scores_alike(tmp_path, prm_base) -> None:
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    train, test = stepwise_records(8), stepwise_records(4, offset=100)
    ours = run_world(run_prm, 1, _config(tmp_path, prm_base, train, test), timeout=TIMEOUT)[0]
    assert ours["rl"] == ours["objective"] == "process_reward_model" and len(ours["losses"]) == STEPS
    tokenizer = AutoTokenizer.from_pretrained(prm_base)
    model = AutoModelForTokenClassification.from_pretrained(prm_base, attn_implementation="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batch, theirs = _rows(tokenizer, train), []  # one micro-batch holds every row: the same loss in any order
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        theirs.append(loss.item())
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs), rtol=1e-5, atol=1e-6)
    assert 0.0 <= ours["metrics"][-1]["accuracy"] <= 1.0
    merged = AutoModelForTokenClassification.from_pretrained(ours["outputs"]["merged"]).eval()
    with torch.no_grad():
        held_out = merged(**_rows(tokenizer, test)).loss.item()
    assert merged.config.num_labels == 2
    assert held_out == pytest.approx(ours["evals"][-1]["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_two_ranks_equal_one_process(tmp_path, prm_base, zero_stage) -> None:
    train, test = stepwise_records(8), stepwise_records(4, offset=100)
    one = run_world(run_prm, 1, _config(tmp_path / "one", prm_base, train, test), timeout=TIMEOUT)[0]
    config = _config(tmp_path / "two", prm_base, train, test, micro_batch_size=4, zero_stage=zero_stage)
    two = run_world(run_prm, 2, config, timeout=TIMEOUT)[0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert two["metrics"][-1]["accuracy"] == pytest.approx(one["metrics"][-1]["accuracy"])


@pytest.mark.parametrize(
    ("layout", "adapter"),
    [
        pytest.param("tp=2", None, marks=pytest.mark.sweep),
        ("cp=2", None),
        pytest.param("pp=2", None, marks=pytest.mark.sweep),
        ("pp=2", "lora"),
        pytest.param("zero_stage=3", "lora", marks=pytest.mark.sweep),
    ],
)  # fmt: skip  (sweep: `make test-full`; the default suite runs each mechanism once)
def test_model_parallel_and_lora_equal_one_process(tmp_path, prm_base, layout, adapter) -> None:
    """Every layout splits the head's per-token terms (cp: each rank its chunks; pp: the last stage), evaluation
    included; a LoRA process reward model trains its head whole beside the adapters."""
    train, test = stepwise_records(8), stepwise_records(4, offset=100)
    lora = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True} if adapter else {}
    one = run_world(run_prm, 1, _config(tmp_path / "one", prm_base, train, test, **lora), timeout=TIMEOUT)[0]
    halves = {"micro_batch_size": 4} if layout.startswith("zero") else {}  # (data parallel: half the rows a rank)
    two_config = _config(tmp_path / "two", prm_base, train, test, **lora, **halves)
    two = run_world(run_prm, 2, two_config, (layout,), timeout=TIMEOUT)[0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert two["evals"][-1]["eval_loss"] == pytest.approx(one["evals"][-1]["eval_loss"], rel=1e-5)
    assert two["metrics"][-1]["accuracy"] == pytest.approx(one["metrics"][-1]["accuracy"])
    if adapter:  # the head trains whole beside the adapters and is saved with them (peft's TOKEN_CLS task)
        from safetensors import safe_open

        with safe_open(str(Path(two["outputs"]["adapter"]) / "adapter_model.safetensors"), framework="pt") as saved:
            names = list(saved.keys())
        assert any(".score." in name for name in names) and any("lora_A" in name for name in names), names
        assert (
            "score"
            not in json.loads((Path(two["outputs"]["adapter"]) / "adapter_config.json").read_text())["target_modules"]
        )
