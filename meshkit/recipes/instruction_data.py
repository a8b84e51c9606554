"""The fine-tune's data in the run's layout: records tokenized, the validation set held out (or read from
`test_datasets`), training rows padded or packed, and the loader of this rank's batches."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from meshkit.data.formats import LoadReport, TokenizedSample, load_samples
from meshkit.data.packing import PackedSamples, PadCollate, PaddedSamples
from meshkit.engine import Engine
from meshkit.errors import MeshkitError


class InstructionDataError(MeshkitError):
    """Data that cannot fill the run's batches; the message says what to change."""


def split_validation(
    samples: list[TokenizedSample], size: float, seed: int
) -> tuple[list[TokenizedSample], list[TokenizedSample]]:
    """(train, validation): `size` < 1 is a share, >= 1 a count; chosen by a seeded shuffle."""
    count = int(size) if size >= 1 else int(round(size * len(samples)))
    if count == 0:
        return samples, []
    if count >= len(samples):
        raise InstructionDataError(f"val_set_size={size} leaves no training samples out of {len(samples)}: lower it")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return [s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)]


@dataclass
class InstructionData:
    train: list[TokenizedSample]
    validation: list[TokenizedSample]
    report: LoadReport
    dataset: PackedSamples | PaddedSamples
    collate: PadCollate
    loader: DataLoader

    @property
    def per_item_tokens(self) -> float:
        return self.dataset.real_tokens / len(self.dataset)


def prepare_data(engine: Engine, settings: Any, tokenizer: Any) -> InstructionData:
    cfg = engine.config
    options = {
        "sequence_len": cfg.train.seq_len,
        "train_on_inputs": settings.train_on_inputs,
        "default_system_message": settings.default_system_message,
    }
    samples, report = load_samples(settings.datasets, tokenizer, **options)
    if settings.test_datasets:
        train, (validation, _) = samples, load_samples(settings.test_datasets, tokenizer, **options)
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
        shuffle=True,
        drop_last=True,
        collate_fn=None if settings.sample_packing else collate,
    )
    return InstructionData(train, validation, report, dataset, collate, loader)
