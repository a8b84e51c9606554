"""The fine-tune's data in the run's layout: records tokenized, the validation set held out (or read from
`test_datasets`), training rows padded or packed, and the loader of this rank's batches."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from meshkit.core.errors import MeshkitError
from meshkit.data.packing import PackedSamples, PadCollate, PaddedSamples
from meshkit.data.selection import shard, without_repeats
from meshkit.data.sources import cpu_share
from meshkit.data.tokenized import LoadReport, TokenizedRows, load_samples
from meshkit.engine.engine import Engine


class InstructionDataError(MeshkitError):
    """Data that cannot fill the run's batches; the message says what to change."""


def held_out(count: int, size: float, seed: int, what: str = "samples") -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of `count` items: `size` < 1 is a share, >= 1 a count; chosen by a
    seeded shuffle."""
    held_count = int(size) if size >= 1 else int(round(size * count))
    if held_count == 0:
        return list(range(count)), []
    if held_count >= count:
        raise InstructionDataError(f"val_set_size={size} leaves no training {what} out of {count}: lower it")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    held = set(order[:held_count])
    return [i for i in range(count) if i not in held], sorted(held)


def split_validation(samples: TokenizedRows, size: float, seed: int) -> tuple[TokenizedRows, TokenizedRows]:
    """(train, validation) of the samples (`held_out`)."""
    train, held = held_out(len(samples), size, seed)
    return samples.take(train), samples.take(held)


def shuffled(samples: TokenizedRows, seed: int) -> TokenizedRows:
    """The merged datasets in a seeded random order (Axolotl's shuffle_merged_datasets)."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    return samples.take(order)


@dataclass
class InstructionData:
    train: TokenizedRows
    validation: TokenizedRows
    report: LoadReport
    dataset: PackedSamples | PaddedSamples
    collate: PadCollate
    loader: DataLoader

    @property
    def per_item_tokens(self) -> float:
        return self.dataset.real_tokens / len(self.dataset)

    @property
    def row_count(self) -> int:
        return len(self.dataset)


def prepare_data(engine: Engine, settings: Any, tokenizer: Any) -> InstructionData:
    cfg = engine.config
    options = {
        "sequence_len": cfg.train.seq_len,
        "train_on_inputs": settings.train_on_inputs,
        "default_system_message": settings.default_system_message,
        "eot_tokens": settings.eot_tokens,
        "chat_template_kwargs": settings.chat_template_kwargs,
        "prepared": Path(settings.dataset_prepared_path) if settings.dataset_prepared_path else None,
        "num_proc": settings.dataset_processes or cpu_share(engine.info.local_world_size),
        "keep_in_memory": settings.dataset_keep_in_memory,
        "seed": cfg.seed,  # (an entry's shards: shuffled with it)
    }
    with engine.main_process_first(per_node=True), _progress_bars(engine.info.local_rank == 0):
        samples, report = load_samples(settings.datasets, tokenizer, **options)
        validation = load_samples(settings.test_datasets, tokenizer, **options)[0] if settings.test_datasets else None
    if settings.shuffle_merged_datasets and len(settings.datasets) > 1:
        samples = shuffled(samples, cfg.seed)
    samples = TokenizedRows(shard(samples.table, settings.dataset_shard_num, settings.dataset_shard_idx))
    if settings.dataset_exact_deduplication:
        table, report.repeated = without_repeats(samples.table, ("input_ids", "labels"))
        samples = TokenizedRows(table)
    if validation is not None:
        train = samples
    else:
        train, validation = split_validation(samples, settings.val_set_size, cfg.seed)
    cp = engine.mesh.size("cp")
    fixed = cfg.train.seq_len if engine.mesh.size("pp") > 1 or settings.pad_to_sequence_len else None
    collate = PadCollate(tokenizer.pad_token_id, multiple_of=2 * cp if cp > 1 else 1, width=fixed)
    dataset: PackedSamples | PaddedSamples = (
        PackedSamples(train, cfg.train.seq_len, tokenizer.pad_token_id)
        if settings.sample_packing
        else PaddedSamples(train)
    )
    per_window = cfg.train.global_micro_batch(engine.dp_size)
    if len(dataset) < per_window:
        raise InstructionDataError(
            f"{len(dataset)} training {'rows' if settings.sample_packing else 'samples'} are fewer than one global "
            f"micro-batch ({per_window}): lower micro_batch_size, or add data ({report.too_long} samples were "
            f"longer than sequence_len={cfg.train.seq_len})"
        )
    loader = DataLoader(
        dataset,
        batch_size=cfg.train.largest_micro_batch,
        shuffle=not settings.curriculum_sampling,
        drop_last=True,
        collate_fn=None if settings.sample_packing else collate,
    )
    return InstructionData(train, validation, report, dataset, collate, loader)


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """`datasets`' progress bars on each node's first rank only (the others read what it prepared)."""
    import datasets

    was_shown = datasets.is_progress_bar_enabled()
    if not shown:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_shown and not shown:
            datasets.enable_progress_bars()
