"""Streamed training data (Axolotl's `streaming: true` and `pretraining_dataset`): records read through `datasets`'
streaming mode, never tokenized as a whole.

Each data-parallel rank takes its share of the stream (`datasets.distributed.split_dataset_by_node`: whole shards
where the files split evenly, else every n-th record), tokenizes records as it reads them, and packs each buffer of
`buffer_size` samples first-fit into rows of `sequence_len` tokens (samples kept apart by their positions, as the
packed rows of a prepared dataset are). Pretraining text longer than a row is cut into row-sized pieces; an SFT
sample longer than a row is dropped. The order is deterministic for a seed (a buffered shuffle when asked), so a
resumed run reads on exactly where it stopped: the loader skips the batches a checkpoint says were read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
        self.epoch = 0  # (set by the loader: a buffered shuffle differs per epoch)
        self.too_long = 0  # SFT samples dropped for not fitting a row
        self.sharded_by_rank = True  # (the loader need not split it)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def records(self) -> Iterator[tuple[DatasetEntry, dict[str, Any]]]:
        """This rank's share of every entry's records, in stream order (entry after entry)."""
        from datasets.distributed import split_dataset_by_node

        for entry in self.entries:
            stream = open_stream(entry)
            skip = getattr(entry, "skip", None)
            if skip:
                stream = stream.skip(skip)
            if self.shuffle:
                stream = stream.shuffle(seed=self.seed, buffer_size=self.buffer_size)
                stream.set_epoch(self.epoch)
            for record in split_dataset_by_node(stream, rank=self.dp_rank, world_size=self.dp_size):
                yield entry, record

    def samples(self) -> Iterator[TokenizedSample]:
        formatters: dict[int, Formatter] = {}
        for entry, record in self.records():
            if self.pretraining or entry.type == "pretrain":
                yield from self._text_pieces(str(record.get(entry.text_column or "text") or ""))
                continue
            formatter = formatters.setdefault(id(entry), Formatter(self.tokenizer, self.train_on_inputs, entry))
            sample = formatter.convert(record, f"{entry.path}: a streamed record", entry.type)
            if len(sample.input_ids) > self.sequence_len:
                self.too_long += 1
                continue
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
        buffer: list[TokenizedSample] = []
        for sample in self.samples():
            buffer.append(sample)
            if len(buffer) == self.buffer_size:
                yield from self._rows(buffer)
                buffer = []
        if buffer:
            yield from self._rows(buffer)

    def _rows(self, buffer: list[TokenizedSample]) -> Iterator[dict[str, torch.Tensor]]:
        packed = PackedSamples(buffer, self.sequence_len, self.tokenizer.pad_token_id)
        for index in range(len(packed)):
            yield packed[index]


def packed_rows_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Packed rows (each already `sequence_len` wide) stacked into a batch."""
    return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}
