"""The built-in recipe's settings (`train.*`), including per-rank micro-batch sizes for mixed hardware."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from meshkit.config.section import Section
from meshkit.config.yaml_text import load_yaml


class TrainConfig(Section):
    """The built-in recipe (`meshkit train`): data, optimiser and loop length."""

    steps: int = Field(200, ge=1, description="optimizer steps")
    micro_batch_size: int | list[int] | dict[int, int] = Field(
        8,
        description="sequences per rank per micro-step; a list (one per data-parallel rank) or a map (node rank -> "
        "size) splits each global batch unevenly, for mixed hardware (prepared DataLoaders follow it)",
    )
    seq_len: int = Field(128, ge=2, description="tokens per sequence")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(10, ge=0, description="linear warm-up steps, then cosine decay")
    log_every: int = Field(10, ge=1, description="tracker logging interval in steps")
    dataset: str = Field("builtin", description="'builtin' (the shipped corpus) or a path to a UTF-8 text file")

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _sizes_from_text(cls, value: Any) -> Any:
        return load_yaml(value) if isinstance(value, str) else value  # `train.micro_batch_size=[8,4]` on a command line

    @field_validator("micro_batch_size")
    @classmethod
    def _sizes_positive(cls, value: Any) -> Any:
        sizes = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
        if not sizes or any(size < 1 for size in sizes):
            raise ValueError(f"{value}: every micro-batch size must be >= 1")
        return value

    @property
    def uneven(self) -> bool:
        """Per-rank sizes given (a list or a map) rather than one size for every rank."""
        return not isinstance(self.micro_batch_size, int)

    @property
    def largest_micro_batch(self) -> int:
        """The largest per-rank size (a DataLoader's batch_size; prepare() re-batches per rank when uneven)."""
        size = self.micro_batch_size
        return max(size) if isinstance(size, list) else max(size.values()) if isinstance(size, dict) else size

    def global_micro_batch(self, dp_size: int) -> int:
        """Samples in one micro-step over every data-parallel rank (a map: the largest node size for each rank)."""
        size = self.micro_batch_size
        if isinstance(size, list):
            return sum(size)
        if isinstance(size, dict):
            return max(size.values()) * dp_size
        return size * dp_size
