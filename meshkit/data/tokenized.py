"""A fine-tune's datasets tokenized with `datasets.map` (several processes, a progress bar) and kept as Arrow
tables, not Python lists: `TokenizedRows` reads one sample at a time.

With a `prepared` directory (Axolotl's `dataset_prepared_path`) each dataset's tokenized table is saved under a
key made of everything its tokens depend on — the records (files and their modification times), the tokenizer
(vocabulary, special tokens, chat template), the dataset entry and the tokenizing settings — and a later run with
the same key reads it instead of tokenizing again. A table is written to a temporary name and renamed into place,
so an interrupted run never leaves a half-written one behind a valid key.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from meshkit.data.dataset_entry import DatasetEntry
from meshkit.data.formats import Formatter, TokenizedSample
from meshkit.data.jsonl import DataFormatError
from meshkit.data.sources import RecordSource, load_source
from meshkit.training.loss import IGNORE_INDEX

FORMAT_VERSION = 3  # bumped whenever the same records and settings would tokenize differently
KEPT, TOO_LONG, NOTHING_TO_TRAIN = 0, 1, 2
ROWS_PER_PROCESS = 512  # below this many records per process, extra tokenizing processes cost more than they save


@dataclass
class LoadReport:
    """What became of the records: kept, dropped as too long, dropped with nothing to train on."""

    kept: int = 0
    too_long: int = 0
    nothing_to_train: int = 0
    repeated: int = 0  # dropped as exact repeats (dataset_exact_deduplication)
    per_file: dict[str, int] = field(default_factory=dict)
    reused: list[str] = field(default_factory=list)  # prepared tables read instead of tokenizing


@dataclass(frozen=True)
class TokenizeOptions:
    sequence_len: int
    train_on_inputs: bool
    default_system_message: str | None = None
    eot_tokens: tuple[str, ...] | None = None  # end-of-turn tokens (Axolotl's eot_tokens); None: the EOS
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()  # the chat template's arguments (hashable)


class TokenizedRows(Sequence[TokenizedSample]):
    """Tokenized samples in an Arrow table (columns input_ids, labels, length), read one at a time."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    @overload
    def __getitem__(self, index: int) -> TokenizedSample: ...
    @overload
    def __getitem__(self, index: slice) -> list[TokenizedSample]: ...
    def __getitem__(self, index: int | slice) -> TokenizedSample | list[TokenizedSample]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        row = self.table[index % len(self)]
        return TokenizedSample(tuple(row["input_ids"]), tuple(row["labels"]))

    def __iter__(self) -> Iterator[TokenizedSample]:
        for row in self.table:
            yield TokenizedSample(tuple(row["input_ids"]), tuple(row["labels"]))

    def lengths(self) -> list[int]:
        return list(self.table["length"])

    def take(self, indices: Sequence[int]) -> TokenizedRows:
        return TokenizedRows(self.table.select(indices))


class _Place:
    """A record's place, worked out only when an error message is formatted (finding a line reads the file)."""

    def __init__(self, source: RecordSource, index: int) -> None:
        self.source, self.index = source, index

    def __str__(self) -> str:
        return self.source.where(self.index)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class _Tokenize:
    """`datasets.map` function: one record -> input_ids, labels, length and its fate (kept or why dropped)."""

    def __init__(self, formatter: Formatter, entry: DatasetEntry, source: RecordSource, sequence_len: int) -> None:
        self.formatter, self.entry, self.source, self.sequence_len = formatter, entry, source, sequence_len

    def __call__(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        sample = self.formatter.convert(record, _Place(self.source, index), self.entry.type)
        fate = KEPT
        if len(sample.input_ids) > self.sequence_len:
            fate = TOO_LONG
        elif all(label == IGNORE_INDEX for label in sample.labels[1:]):
            fate = NOTHING_TO_TRAIN
        return {"input_ids": sample.input_ids, "labels": sample.labels, "length": len(sample.input_ids), "fate": fate}


def _features() -> Any:
    from datasets import Features, List, Value

    return Features(
        {
            "input_ids": List(Value("int32")),
            "labels": List(Value("int32")),
            "length": Value("int32"),
            "fate": Value("int8"),
        }
    )


def _key(entry: DatasetEntry, options: TokenizeOptions, tokenizer: Any, source: RecordSource, seed: int = 0) -> str:
    from datasets.fingerprint import Hasher

    files = [*source.files, *(item["filename"] for item in source.dataset.cache_files)]
    stats = [(name, os.stat(name).st_size, os.stat(name).st_mtime_ns) for name in files if os.path.exists(name)]
    identity = stats or Hasher.hash(source.dataset)
    shuffled = seed if entry.shards else None  # (an entry's shard depends on the seed its records are shuffled with)
    return Hasher.hash(
        [FORMAT_VERSION, entry.model_dump(mode="json"), options, Hasher.hash(tokenizer), identity, shuffled]
    )


def tokenize_entry(
    entry: DatasetEntry,
    tokenizer: Any,
    options: TokenizeOptions,
    *,
    prepared: Path | None = None,
    num_proc: int | None = None,
    keep_in_memory: bool = False,
    seed: int = 0,
) -> tuple[Any, bool]:
    """(the entry's tokenized table with a `fate` column, whether it was read from `prepared`)."""
    from datasets import load_from_disk

    source = load_source(entry, keep_in_memory, seed)
    key = _key(entry, options, tokenizer, source, seed)
    target = prepared / key if prepared is not None else None
    if target is not None and (target / "state.json").is_file():
        return load_from_disk(str(target), keep_in_memory=keep_in_memory), True
    formatter = Formatter(
        tokenizer,
        options.train_on_inputs,
        entry,
        default_system_message=options.default_system_message,
        eot_tokens=options.eot_tokens,
        chat_template_kwargs=dict(options.chat_template_kwargs),
    )
    records = source.dataset
    processes = max(1, min(num_proc or 1, len(records) // ROWS_PER_PROCESS))
    table = records.map(
        _Tokenize(formatter, entry, source, options.sequence_len),
        with_indices=True,
        remove_columns=records.column_names,
        features=_features(),
        num_proc=processes if processes > 1 else None,
        desc=f"meshkit: tokenizing {source.label}",
        new_fingerprint=key,
        keep_in_memory=keep_in_memory,
    )
    if target is not None:
        _save(table, target)
    return table, False


def _save(table: Any, target: Path) -> None:
    """Write `table` to `target` whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    table.save_to_disk(str(partial))
    try:
        os.replace(partial, target)
    except OSError:  # another process saved the same key first: its table is the same
        shutil.rmtree(partial, ignore_errors=True)


def load_samples(
    datasets: Sequence[tuple[str | os.PathLike[str], str] | DatasetEntry],
    tokenizer: Any,
    *,
    sequence_len: int,
    train_on_inputs: bool,
    default_system_message: str | None = None,
    eot_tokens: tuple[str, ...] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    prepared: Path | None = None,
    num_proc: int | None = None,
    keep_in_memory: bool = False,
    seed: int = 0,
) -> tuple[TokenizedRows, LoadReport]:
    """Every dataset's samples, tokenized, in dataset then record order; over-long and untrainable samples are
    dropped and counted."""
    from datasets import concatenate_datasets

    template_kwargs = tuple(sorted((chat_template_kwargs or {}).items()))
    options = TokenizeOptions(sequence_len, train_on_inputs, default_system_message, eot_tokens, template_kwargs)
    report, tables = LoadReport(), []
    for item in datasets:
        entry = _entry(item)
        table, reused = tokenize_entry(
            entry, tokenizer, options, prepared=prepared, num_proc=num_proc, keep_in_memory=keep_in_memory, seed=seed
        )
        fates = list(table["fate"])
        counts = Counter(fates)
        report.too_long += counts[TOO_LONG]
        report.nothing_to_train += counts[NOTHING_TO_TRAIN]
        report.per_file[entry.path] = counts[KEPT]
        if reused:
            report.reused.append(entry.path)
        tables.append(
            table if counts[KEPT] == len(fates) else table.select([i for i, f in enumerate(fates) if f == KEPT])
        )
    rows = TokenizedRows(concatenate_datasets(tables) if len(tables) > 1 else tables[0])
    report.kept = len(rows)
    return rows, report


def _entry(item: tuple[str | os.PathLike[str], str] | DatasetEntry) -> DatasetEntry:
    if isinstance(item, DatasetEntry):
        return item
    try:
        return DatasetEntry(path=os.fspath(item[0]), type=item[1])
    except ValueError as err:
        raise DataFormatError(f"dataset '{item[0]}': {str(err).splitlines()[-1].strip()}") from None
