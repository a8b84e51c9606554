"""Axolotl's dataset types beyond the common ones: its built-in instruction prompters (jeopardy, oasst, gpteacher,
summarizetldr, explainchoice, concisechoice) and an entry without `type` (records tokenized already)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.jsonl import DataFormatError  # noqa: E402
from meshkit.data.tokenized import load_samples  # noqa: E402
from meshkit.training.loss import IGNORE_INDEX  # noqa: E402
from tests.helpers.finetune_runs import write_jsonl  # noqa: E402


def _trained(tokenizer, sample) -> str:
    return tokenizer.decode(
        [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
    )


@pytest.mark.parametrize(
    ("kind", "record", "prompt", "answer"),
    [
        ("jeopardy", {"question": "It flows", "category": "NATURE", "answer": "a river"},
         "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
         "response that appropriately completes the request.\n\n### Instruction:\nIt flows\n\n### Input:\nNATURE"
         "\n\n### Response:\n", "what is a river"),
        ("oasst", {"INSTRUCTION": "Say hi", "RESPONSE": "hi"},
         "Below is an instruction that describes a task. Write a response that appropriately completes the request."
         "\n\n### Instruction:\nSay hi\n\n### Response:\n", "hi"),
        ("summarizetldr", {"article": "Long text.", "summary": "Short."},
         "USER: Summarize the following article as a TL;DR.\nLong text.\nASSISTANT:", "Short."),
        ("concisechoice", {"question": "Which?", "choices": ["a", "b"], "solution": "a"},
         "Choose the answer that best answers the question. Be concise in your response.\n\nUSER: Which?\n- \"a\""
         "\n- \"b\"\nASSISTANT:", "a"),
    ],
)  # fmt: skip
def test_axolotls_builtin_instruction_types_write_its_prompts(tmp_path, tokenizer, kind, record, prompt, answer):
    path = write_jsonl(tmp_path / "r.jsonl", [record])
    (sample,) = load_samples([DatasetEntry(path=path, type=kind)], tokenizer, sequence_len=512, train_on_inputs=False)[
        0
    ]
    expected = tokenizer(prompt)["input_ids"]
    assert list(sample.input_ids[: len(expected)]) == expected
    assert _trained(tokenizer, sample).strip().startswith(answer)


def test_an_entry_without_a_type_reads_records_tokenized_already(tmp_path, tokenizer) -> None:
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": ids[0], "labels": [-100, -100, 7, 8]},
                                              {"input_ids": ids[1], "attention_mask": [1, 1, 1]}])  # fmt: skip
    entry = DatasetEntry(path=path)  # (Axolotl: `type:` left empty)
    first, second = load_samples([entry], tokenizer, sequence_len=64, train_on_inputs=False)[0]
    assert list(first.input_ids) == ids[0] and list(first.labels) == [-100, -100, 7, 8]
    assert list(second.labels) == ids[1]  # no labels: every token trains
    untyped = write_jsonl(tmp_path / "u.jsonl", [{"instruction": "hi", "output": "there"}])
    with pytest.raises(DataFormatError, match="u.jsonl:1: an entry without type reads records tokenized already"):
        load_samples([DatasetEntry(path=untyped)], tokenizer, sequence_len=64, train_on_inputs=False)
    bad = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(DataFormatError, match=r"b.jsonl:1: labels must be a list as long as input_ids \(2 tokens\)"):
        load_samples([DatasetEntry(path=bad)], tokenizer, sequence_len=64, train_on_inputs=False)
