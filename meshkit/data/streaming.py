"""Streamed training data (Axolotl's `streaming: true` and `pretraining_dataset`): records read through `datasets`'
streaming mode, never tokenized as a whole.

Each data-parallel rank takes its share of the stream (`datasets.distributed.split_dataset_by_node`: whole shards
where the files split evenly, else every n-th record), tokenizes records as it reads them, and packs each buffer of
`buffer_size` samples first-fit into rows of `sequence_len` tokens (samples kept apart by their positions, as the
packed rows of a prepared dataset are). Pretraining text longer than a row is cut into row-sized pieces; an SFT
sample longer than a row is dropped. With `shuffle` the samples of each buffer are put in a random order before
packing (seeded by the run's seed, the epoch and the buffer's number): a shuffle at the buffer's scale, like
`datasets`' buffered shuffle, but one a checkpoint can hold exactly.

A checkpoint holds each rank's place in its stream (`state_dict`): where the pack buffer now being read began — the
entry, `datasets`' own state of that entry's stream before the record then in hand, and how many of that record's
samples went into earlier buffers — and how many rows of the buffer were read. A resumed run opens the stream there,
refills that one buffer and reads on from the next row: nothing before it is read or tokenized again. (`datasets`'
own shuffle buffer is not part of its state: its resume is not exact, so it is not used.)
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch.utils.data import IterableDataset

from meshkit.data.dataset_entry import DatasetEntry
from meshkit.data.formats import Formatter, TokenizedSample
from meshkit.data.jsonl import DataFormatError
from meshkit.data.packing import PackedSamples
from meshkit.data.sources import BUILDERS, split_name


def open_stream(entry: DatasetEntry) -> Any:
    """`entry`'s records as a `datasets` IterableDataset (local files or directories, or a cached hub dataset)."""
    from pathlib import Path

    from datasets import load_dataset

    name, sliced = split_name(entry.split)
    if sliced:
        raise DataFormatError(
            f"dataset '{entry.path}': a streamed split cannot be sliced ({entry.split}): drop the slice"
        )
    local = Path(entry.path).expanduser()
    options: dict[str, Any] = {"split": name, "streaming": True}
    if local.is_file():
        builder = entry.ds_type or BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise DataFormatError(f"dataset '{local}': meshkit cannot tell the format of the file: set ds_type")
        return load_dataset(builder, data_files={name: [str(local)]}, **options)
    if local.is_dir():
        files = entry.data_files
        data_files = {name: [str(local / f) for f in ([files] if isinstance(files, str) else files)]} if files else None
        return load_dataset(entry.ds_type or str(local), data_files=data_files, **options)
    try:
        return load_dataset(entry.path, name=entry.name, revision=entry.revision, **options)
    except Exception as err:  # (offline: only what this machine's caches hold)
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataFormatError(f"dataset '{entry.path}' cannot be streamed here: {reason[:200]}") from None


@dataclass(frozen=True)
class StreamMark:
    """Where a pack buffer began: entry `entry`'s stream at `before_record` (`datasets`' state before the record
    then in hand; None: the entry's start), `pieces` of that record's samples already in earlier buffers, and the
    SFT samples dropped for length so far."""

    entry: int = 0
    before_record: dict[str, Any] | None = None
    pieces: int = 0
    too_long: int = 0
    buffer: int = 0  # the buffer's number in the epoch (its shuffle's seed)


class StreamedRows(IterableDataset):
    """This rank's packed rows of the streamed `entries`, read lazily; `pretraining`: the entries are plain text
    (`text_column`), every token trained, long texts cut into rows."""

    def __init__(
        self,
        entries: Sequence[DatasetEntry],
        tokenizer: Any,
        *,
        sequence_len: int,
        buffer_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        pretraining: bool,
        train_on_inputs: bool = False,
    ) -> None:
        self.entries, self.tokenizer = list(entries), tokenizer
        self.sequence_len, self.buffer_size = sequence_len, buffer_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.pretraining, self.train_on_inputs = pretraining, train_on_inputs
        self.epoch = 0  # (set by the loader: the shuffle differs per epoch)
        self.too_long = 0  # SFT samples dropped for not fitting a row
        self.sharded_by_rank = True  # (the loader need not split it)
        self._reading = StreamMark()  # the record in hand (pieces: its samples read so far)
        self._buffer_mark = StreamMark()  # where the buffer now being read began
        self._rows_read = 0  # rows of that buffer read
        self._resume: dict[str, Any] | None = None  # a checkpoint's place, taken at the next iteration

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _stream(self, entry: DatasetEntry) -> Any:
        """This rank's share of `entry`'s records as a `datasets` IterableDataset."""
        from datasets.distributed import split_dataset_by_node

        stream = open_stream(entry)
        skip = getattr(entry, "skip", None)
        if skip:
            stream = stream.skip(skip)
        return split_dataset_by_node(stream, rank=self.dp_rank, world_size=self.dp_size)

    def records(self, start: StreamMark | None = None) -> Iterator[tuple[DatasetEntry, dict[str, Any]]]:
        """This rank's share of every entry's records, in stream order (entry after entry), from `start` on (the
        record in hand there included); `self._reading` follows the record in hand."""
        start = start or StreamMark()
        for index, entry in enumerate(self.entries[start.entry :], start=start.entry):
            stream = self._stream(entry)
            if index == start.entry and start.before_record is not None:
                stream.load_state_dict(start.before_record)
            before = stream.state_dict()
            for record in stream:
                self._reading = StreamMark(index, before, 0, self.too_long)
                yield entry, record
                before = stream.state_dict()

    def samples(self, start: StreamMark | None = None) -> Iterator[TokenizedSample]:
        """The tokenized samples from `start` on (the pieces of its record read before it left out)."""
        formatters: dict[int, Formatter] = {}
        skip = start.pieces if start is not None else 0  # (of the first record: the one in hand at `start`)
        for entry, record in self.records(start):
            for piece, sample in enumerate(self._samples_of(entry, record, formatters)):
                self._reading = replace(self._reading, pieces=piece + 1)
                if piece >= skip:
                    yield sample
            skip = 0

    def _samples_of(
        self, entry: DatasetEntry, record: dict[str, Any], formatters: dict[int, Formatter]
    ) -> Iterator[TokenizedSample]:
        if self.pretraining or entry.type == "pretrain":
            yield from self._text_pieces(str(record.get(entry.text_column or "text") or ""))
            return
        formatter = formatters.setdefault(id(entry), Formatter(self.tokenizer, self.train_on_inputs, entry))
        sample = formatter.convert(record, f"{entry.path}: a streamed record", entry.type)
        if len(sample.input_ids) > self.sequence_len:
            self.too_long += 1
            return
        yield sample

    def _text_pieces(self, text: str) -> Iterator[TokenizedSample]:
        """A pretraining text with BOS and EOS, cut into pieces of at most `sequence_len` tokens."""
        ids = list(self.tokenizer(text)["input_ids"])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        for start in range(0, len(ids), self.sequence_len):
            piece = tuple(ids[start : start + self.sequence_len])
            if len(piece) > 1:
                yield TokenizedSample(piece, piece)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start, skip_rows = self._take_resume()
        self.too_long = start.too_long
        self._buffer_mark, buffer = start, []
        for sample in self.samples(start):
            buffer.append(sample)
            if len(buffer) == self.buffer_size:
                yield from self._rows(buffer, skip_rows)
                skip_rows, buffer = 0, []
                self._buffer_mark = replace(self._reading, buffer=self._buffer_mark.buffer + 1)
        if buffer:
            yield from self._rows(buffer, skip_rows)

    def _rows(self, buffer: list[TokenizedSample], skip: int) -> Iterator[dict[str, torch.Tensor]]:
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}:{self._buffer_mark.buffer}").shuffle(buffer)
        packed = PackedSamples(buffer, self.sequence_len, self.tokenizer.pad_token_id)
        for index in range(len(packed)):
            self._rows_read = index + 1
            if index >= skip:
                yield packed[index]
        self._rows_read = 0

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """This rank's place in its stream (JSON)."""
        mark = asdict(self._buffer_mark)
        return {"epoch": self.epoch, "dp": [self.dp_rank, self.dp_size], "rows_read": self._rows_read, **mark}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Read on from `state` at the next iteration; False (nothing changed) where it was saved by a rank with
        another share of the stream."""
        if list(state.get("dp", ())) != [self.dp_rank, self.dp_size]:
            return False
        self._resume = copy.deepcopy(state)
        return True

    def _take_resume(self) -> tuple[StreamMark, int]:
        state, self._resume = self._resume, None
        if state is None or int(state["epoch"]) != self.epoch:
            return StreamMark(), 0
        fields = {name: state[name] for name in ("entry", "before_record", "pieces", "too_long", "buffer")}
        return StreamMark(**fields), int(state["rows_read"])


def packed_rows_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Packed rows (each already `sequence_len` wide) stacked into a batch."""
    return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}
