"""Preference records as Axolotl's types read them, tokenized as TRL does, and batched for the objectives."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")

from meshkit.data.dataset_entry import DatasetEntry, is_preference_type  # noqa: E402
from meshkit.data.jsonl import DataFormatError  # noqa: E402
from meshkit.data.preference_formats import PairText, PreferenceFormatter, UnpairedText  # noqa: E402
from meshkit.data.preference_tokens import (  # noqa: E402
    PreferenceCollate,
    PreferenceTokenizer,
    load_preference_records,
    with_kl_completions,
)
from meshkit.training.loss import IGNORE_INDEX  # noqa: E402

IM = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
L3 = "<|start_header_id|>user<|end_header_id|>\n\n{q}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


def _pair(tokenizer, kind, record, **entry) -> PairText:
    return PreferenceFormatter(tokenizer, DatasetEntry(path=".", type=kind, **entry)).pair(record, "r:1")


@pytest.mark.parametrize(
    ("kind", "record", "expected"),
    [
        (
            "chatml.intel",
            {"question": "q", "chosen": "a", "rejected": "b"},
            (IM.format(q="q"), "a<|im_end|>", "b<|im_end|>"),
        ),  # noqa: E501
        (
            "chatml.icr",
            {"input": "q", "chosen": "a", "rejected": "b"},
            (IM.format(q="q"), "a<|im_end|>", "b<|im_end|>"),
        ),
        (
            "chatml.default",
            {"instruction": "q", "chosen_response": "a", "rejected_response": "b"},
            (IM.format(q="q"), "a<|im_end|>", "b<|im_end|>"),
        ),  # noqa: E501
        (
            "chatml.ultra",
            {
                "prompt": "q",
                "chosen": [{"content": "q"}, {"content": "a"}],
                "rejected": [{"content": "q"}, {"content": "b"}],
            },  # noqa: E501
            (IM.format(q="q"), "a<|im_end|>", "b<|im_end|>"),
        ),
        (
            "llama3.argilla_chat",
            {"chosen": [{"content": "q"}, {"content": "a"}], "rejected": [{"content": "q"}, {"content": "b"}]},
            (L3.format(q="q"), "a<|eot_id|>", "b<|eot_id|>"),
        ),
        (
            "chatml.prompt_pairs",
            {"prompt": "q", "system": "s", "chosen": "a", "rejected": "b"},
            ("<|im_start|>system\ns<|im_end|>\n" + IM.format(q="q"), "a<|im_end|>", "b<|im_end|>"),
        ),
        (
            "zephyr.nectar",
            {
                "prompt": "q",
                "answers": [{"answer": "x", "rank": 3}, {"answer": "best", "rank": 1}, {"answer": "ok", "rank": 2}],
            },  # noqa: E501
            ("<|system|>\n</s>\n<|user|>\nq</s>\n<|assistant|>\n", "x", "ok"),
        ),
        ("passthrough", {"prompt": "p", "chosen": "a", "rejected": "b"}, ("p", "a", "b")),
    ],
)
def test_axolotl_pair_types_give_prompt_chosen_rejected(tokenizer, kind, record, expected) -> None:
    assert _pair(tokenizer, kind, record) == PairText(*expected)


def test_chat_template_default_maps_fields_and_roles(tokenizer) -> None:
    record = {
        "conversation": [{"from": "human", "value": "Shout river"}],
        "good": {"from": "gpt", "value": "RIVER"},
        "bad": [{"from": "human", "value": "Shout river"}, {"from": "gpt", "value": "river"}],
    }
    text = _pair(
        tokenizer, "chat_template.default", record, field_messages="conversation", field_chosen="good",
        field_rejected="bad", message_property_mappings={"role": "from", "content": "value"},
        roles={"user": ["human"], "assistant": ["gpt"]}, chat_template="chatml",
    )  # fmt: skip
    assert text == PairText(IM.format(q="Shout river"), "RIVER<|im_end|>", "river<|im_end|>")
    argilla = {"chosen": record["bad"][:1] + [record["good"]], "rejected": record["bad"]}
    mapped = {"message_property_mappings": {"role": "from", "content": "value"}, "chat_template": "chatml"}
    same = _pair(tokenizer, "chat_template.argilla", argilla, roles={"user": ["human"], "assistant": ["gpt"]}, **mapped)
    assert same == text
    record = {"messages": "Shout river", "chosen": "RIVER", "rejected": "x"}
    one_string = _pair(tokenizer, "chat_template.default", record, chat_template="chatml")
    assert one_string.prompt == IM.format(q="Shout river") and one_string.chosen == "RIVER<|im_end|>"


def test_user_defined_and_kto_types(tokenizer) -> None:
    spec = {
        "field_prompt": "q",
        "field_chosen": "good",
        "field_rejected": "bad",
        "prompt_format": "[{system}] {prompt}:",
    }
    text = _pair(tokenizer, spec, {"q": "hi", "good": "yes", "bad": "no", "system": "s"})
    assert text == PairText("[s] hi:", "yes", "no")
    kto = PreferenceFormatter(tokenizer, DatasetEntry(path=".", type="llama3.intel"))
    assert kto.unpaired({"question": "q", "completion": "a", "label": False}, "r:1") == UnpairedText(
        L3.format(q="q"), "a<|eot_id|>", False
    )  # noqa: E501
    with pytest.raises(DataFormatError, match="r:1: 'label' must be true"):
        kto.unpaired({"question": "q", "completion": "a", "label": "maybe"}, "r:1")


def test_preference_types_are_recognised_and_a_missing_field_is_one_line(tokenizer) -> None:
    assert is_preference_type("chat_template.default") and is_preference_type("chatml.intel")
    assert not is_preference_type("chat_template") and not is_preference_type("alpaca")
    with pytest.raises(DataFormatError, match="r:1: the record has no 'question' field") as caught:
        _pair(tokenizer, "chatml.intel", {"prompt": "q", "chosen": "a", "rejected": "b"})
    assert "\n" not in str(caught.value)


def test_tokenized_like_trl_and_batched_chosen_then_rejected(tokenizer) -> None:
    ids = PreferenceTokenizer(tokenizer).pair(PairText("Shout apple:", " APPLE", " apple"))
    assert ids["prompt_ids"][0] == tokenizer.bos_token_id  # the tokenizer's own special tokens
    assert ids["chosen_ids"][-1] == ids["rejected_ids"][-1] == tokenizer.eos_token_id  # EOS appended (TRL)
    whole = tokenizer("Shout apple: APPLE" + tokenizer.eos_token)["input_ids"]
    assert ids["prompt_ids"] + ids["chosen_ids"] == whole
    other = PreferenceTokenizer(tokenizer).pair(PairText("Shout river:", " RIVER", " r"))
    batch = PreferenceCollate(tokenizer.pad_token_id, sequence_len=64, multiple_of=4)([ids, other])
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] % 4 == 0
    prompt = len(ids["prompt_ids"])
    assert (batch["labels"][0, :prompt] == IGNORE_INDEX).all()  # prompt tokens never count
    assert batch["labels"][0, prompt : prompt + len(ids["chosen_ids"])].tolist() == ids["chosen_ids"]
    assert batch["labels"][2, prompt : prompt + len(ids["rejected_ids"])].tolist() == ids["rejected_ids"]
    cut = PreferenceCollate(tokenizer.pad_token_id, sequence_len=prompt + 2)([ids])
    assert cut["input_ids"].shape[1] == prompt + 2  # TRL's keep_start: each row cut to sequence_len


def test_long_prompts_are_dropped_and_counted_and_kto_gets_mismatched_rows(tmp_path, tokenizer) -> None:
    path = tmp_path / "kto.jsonl"
    records = [{"prompt": f"word {i}:", "completion": f" c{i}", "label": i % 2 == 0} for i in range(5)]
    records.append({"prompt": "very " * 80 + ":", "completion": " x", "label": True})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    table, report = load_preference_records(
        [DatasetEntry(path=str(path), type="passthrough")], tokenizer, paired=False, sequence_len=32
    )
    assert len(table) == report.kept == 5 and report.prompt_too_long == 1
    rotated = with_kl_completions(table, group=2)
    kl = rotated["kl_completion_ids"]
    completions = table["completion_ids"]
    assert kl[0] == completions[1] and kl[1] == completions[0] and kl[4] == completions[4]
    batch = PreferenceCollate(tokenizer.pad_token_id, 32, paired=False)([dict(rotated[i]) for i in range(2)])
    assert batch["desirable"].tolist() == [True, False] and batch["kl_input_ids"].shape[0] == 2
