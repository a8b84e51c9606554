"""Fine-tuning batches: padded samples, or samples packed into fixed-length rows.

A packed row holds several samples back to back; its `position_ids` restart at 0 with each sample, which is
how transformers models keep attention inside each sample (no attention mask: the model derives one block of
causal attention per run of consecutive positions), and each sample's first token gets label -100 so that no
sample is trained to predict the next one's start. A packed row therefore gives the same per-sample losses as
the samples one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from meshkit.data.formats import TokenizedSample
from meshkit.data.tokenized import TokenizedRows
from meshkit.training.loss import IGNORE_INDEX

OPEN_ROWS = 64  # rows still open for first-fit packing (bounds the work per sample on large datasets)


@dataclass(frozen=True)
class PackedRow:
    samples: tuple[int, ...]  # indices of the samples packed into this row, in order
    length: int  # tokens used (the rest is padding)


def pack(lengths: Sequence[int], sequence_len: int) -> list[PackedRow]:
    """First-fit packing in sample order: each sample goes into the first open row with room for it."""
    rows: list[list[int]] = []
    used: list[int] = []
    first_open = 0
    for index, length in enumerate(lengths):
        if length > sequence_len:
            raise ValueError(f"sample {index} has {length} tokens, more than sequence_len={sequence_len}")
        target = next((row for row in range(first_open, len(rows)) if used[row] + length <= sequence_len), None)
        if target is None:
            rows.append([])
            used.append(0)
            target = len(rows) - 1
            first_open = max(first_open, len(rows) - OPEN_ROWS)
        rows[target].append(index)
        used[target] += length
    return [PackedRow(tuple(row), total) for row, total in zip(rows, used, strict=True)]


def sample_lengths(samples: Sequence[TokenizedSample]) -> list[int]:
    """Tokens per sample; a tokenized table answers from its length column without reading the samples."""
    if isinstance(samples, TokenizedRows):
        return samples.lengths()
    return [len(sample.input_ids) for sample in samples]


class PaddedSamples(Dataset):
    """One sample per item; `pad_collate` pads a batch on the right."""

    def __init__(self, samples: Sequence[TokenizedSample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def real_tokens(self) -> int:
        """Tokens of all items, padding excluded."""
        return sum(sample_lengths(self.samples))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        return {"input_ids": torch.tensor(sample.input_ids), "labels": torch.tensor(sample.labels)}


class PadCollate:
    """Right-pads `input_ids` (with the pad id), `labels` (with -100) and sets `attention_mask`."""

    def __init__(self, pad_id: int, multiple_of: int = 1, width: int | None = None) -> None:
        self.pad_id = pad_id
        self.multiple_of = multiple_of  # e.g. 2 × cp: context parallel splits the sequence into equal chunks
        self.width = width  # every batch this wide (a pipeline's stages are built for one activation shape)

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        width = self.width or -(-longest // self.multiple_of) * self.multiple_of
        batch = {
            "input_ids": torch.full((len(items), width), self.pad_id, dtype=torch.long),
            "labels": torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.zeros((len(items), width), dtype=torch.long),
        }
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            batch["input_ids"][row, :n] = item["input_ids"]
            batch["labels"][row, :n] = item["labels"]
            batch["attention_mask"][row, :n] = 1
        return batch


class PackedSamples(Dataset):
    """Rows of `sequence_len` tokens, each packing several samples (see the module docstring)."""

    def __init__(self, samples: Sequence[TokenizedSample], sequence_len: int, pad_id: int) -> None:
        self.samples = samples
        self.sequence_len = sequence_len
        self.pad_id = pad_id
        self.rows = pack(sample_lengths(samples), sequence_len)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def real_tokens(self) -> int:
        """Tokens of all rows, padding excluded."""
        return sum(row.length for row in self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for sample_index in self.rows[index].samples:
            sample = self.samples[sample_index]
            ids.extend(sample.input_ids)
            labels.extend((IGNORE_INDEX, *sample.labels[1:]))  # never predict this sample from the previous one
            positions.extend(range(len(sample.input_ids)))
        pad = self.sequence_len - len(ids)
        ids.extend([self.pad_id] * pad)
        labels.extend([IGNORE_INDEX] * pad)
        positions.extend(range(pad))  # padding is a run of its own: real tokens never attend to it
        return {
            "input_ids": torch.tensor(ids),
            "labels": torch.tensor(labels),
            "position_ids": torch.tensor(positions),
        }
