"""The fine-tune's streamed data (`streaming: true`, `pretraining_dataset`): this rank's packed rows read lazily
(`meshkit.data.streaming`), in the shape the recipe reads prepared data in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader

from meshkit.data.streaming import StreamedRows, packed_rows_collate
from meshkit.data.tokenized import LoadReport
from meshkit.engine.engine import Engine


@dataclass
class StreamData:
    """What the recipe reads of its data, for a stream: no held-out samples, rows counted by the steps."""

    dataset: StreamedRows
    loader: DataLoader
    row_count: int  # rows the run reads (max_steps × rows per step): a stream's length is not known
    sequence_len: int
    train: tuple[Any, ...] = ()
    validation: list[Any] = field(default_factory=list)
    report: LoadReport = field(default_factory=LoadReport)
    collate: Any = packed_rows_collate

    @property
    def per_item_tokens(self) -> float:
        return float(self.sequence_len)  # (packed rows: padding counted)


def prepare_stream(engine: Engine, settings: Any, tokenizer: Any, total_steps: int) -> StreamData:
    cfg = engine.config
    pretraining = bool(settings.pretraining_dataset)
    rows = StreamedRows(
        settings.pretraining_dataset or settings.datasets,
        tokenizer,
        sequence_len=cfg.train.seq_len,
        buffer_size=settings.streaming_multipack_buffer_size,
        dp_rank=engine.dp_rank,
        dp_size=engine.dp_size,
        seed=cfg.seed,
        shuffle=settings.shuffle_merged_datasets,
        pretraining=pretraining,
        train_on_inputs=settings.train_on_inputs,
    )
    loader = DataLoader(rows, batch_size=cfg.train.largest_micro_batch, collate_fn=packed_rows_collate)
    per_step = cfg.train.global_micro_batch(engine.dp_size) * cfg.grad_accum_steps
    return StreamData(rows, loader, total_steps * per_step, cfg.train.seq_len)
