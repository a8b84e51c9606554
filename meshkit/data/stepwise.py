"""A process reward model's data (`type: stepwise_supervised`, Axolotl's and TRL's format): each record holds a
`prompt`, its reasoning `completions` (one string per step) and one `labels` entry per step (is the step right).

A record becomes one row: BOS (when the tokenizer has one) + prompt + each step followed by `step_separator`; the
label of a step sits on its last token (the separator's), every other position is -100, so the token
classification head learns to judge each step where it ends. `train_on_last_step_only` keeps only the last step's
label; `max_completion_length` cuts the steps' tokens; rows longer than `sequence_len` are cut to it (as Axolotl
does) and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from meshkit.data.dataset_entry import DatasetEntry
from meshkit.data.jsonl import DataFormatError
from meshkit.data.preference_tokens import padded
from meshkit.data.sources import load_source

IGNORE_INDEX = -100


@dataclass
class StepwiseReport:
    kept: int = 0
    truncated: int = 0  # rows cut to sequence_len
    repeated: int = 0  # dropped as exact repeats (dataset_exact_deduplication)
    per_file: dict[str, int] = field(default_factory=dict)


def tokenize_steps(
    record: dict[str, Any], tokenizer: Any, entry: DatasetEntry, sequence_len: int, where: str = "a record"
) -> dict[str, Any]:
    """One record's row: `input_ids` and `labels` (a step's label on its last token, -100 elsewhere)."""
    missing = [key for key in ("prompt", "completions", "labels") if record.get(key) is None]
    if missing:
        raise DataFormatError(
            f"{where}: a stepwise_supervised record needs {', '.join(missing)} (it has {sorted(record)})"
        )
    steps, marks = list(record["completions"]), [int(label) for label in record["labels"]]
    if len(steps) != len(marks) or not steps:
        raise DataFormatError(f"{where}: {len(steps)} completions (steps) but {len(marks)} labels: one label per step")
    if entry.train_on_last_step_only:
        marks = [IGNORE_INDEX] * (len(marks) - 1) + marks[-1:]
    separator = tokenizer.encode(entry.step_separator, add_special_tokens=False)
    step_ids = [tokenizer(step, add_special_tokens=False)["input_ids"] + separator for step in steps]
    completion = list(chain(*step_ids))
    labels = list(chain(*([IGNORE_INDEX] * (len(ids) - 1) + [mark] for ids, mark in zip(step_ids, marks, strict=True))))
    if entry.max_completion_length:
        completion, labels = completion[: entry.max_completion_length], labels[: entry.max_completion_length]
    prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        prompt = [tokenizer.bos_token_id, *prompt]
    input_ids, row_labels = prompt + completion, [IGNORE_INDEX] * len(prompt) + labels
    return {
        "input_ids": input_ids[:sequence_len],
        "labels": row_labels[:sequence_len],
        "cut": len(input_ids) > sequence_len,
    }


class _Tokenize:
    def __init__(self, tokenizer: Any, entry: DatasetEntry, sequence_len: int, source: Any) -> None:
        self.tokenizer, self.entry, self.sequence_len, self.source = tokenizer, entry, sequence_len, source

    def __call__(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        return tokenize_steps(record, self.tokenizer, self.entry, self.sequence_len, self.source.where(index))


def load_stepwise_records(
    datasets: Sequence[DatasetEntry], tokenizer: Any, *, sequence_len: int, keep_in_memory: bool = False, seed: int = 0
) -> tuple[Any, StepwiseReport]:
    """Every dataset's records as rows (an Arrow table: input_ids, labels), in dataset then record order."""
    from datasets import Features, Sequence, Value, concatenate_datasets

    # (stated: `datasets` would otherwise keep the records' own `labels` type, booleans, for the new column)
    features = Features(
        {"input_ids": Sequence(Value("int64")), "labels": Sequence(Value("int64")), "cut": Value("bool")}
    )
    report, tables = StepwiseReport(), []
    for entry in datasets:
        source = load_source(entry, keep_in_memory, seed)
        records = source.dataset
        table = records.map(
            _Tokenize(tokenizer, entry, sequence_len, source),
            with_indices=True,
            remove_columns=records.column_names,
            features=features,
            desc=f"meshkit: tokenizing {source.label}",
            keep_in_memory=keep_in_memory,
        )
        report.truncated += sum(table["cut"])
        report.per_file[entry.path] = len(table)
        tables.append(table.remove_columns("cut"))
    merged = concatenate_datasets(tables) if len(tables) > 1 else tables[0]
    report.kept = len(merged)
    return merged, report


@dataclass
class StepCollate:
    """Rows right-padded with `pad_token_id` (labels with -100), with the attention mask; widths as
    `meshkit.data.preference_tokens.padded` makes them."""

    pad_token_id: int
    multiple_of: int = 1
    width: int | None = None

    def __call__(self, records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [(list(r["input_ids"]), list(r["labels"])) for r in records]
        return padded(rows, self.pad_token_id, self.multiple_of, self.width)
