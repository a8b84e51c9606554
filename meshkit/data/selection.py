"""Which records train: Axolotl's `dataset_exact_deduplication` (records that repeat another exactly, dropped) and
`dataset_shard_num` / `dataset_shard_idx` (one contiguous shard of the merged records), on Arrow tables."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def first_occurrences(table: Any, columns: Sequence[str]) -> list[int]:
    """Indices of the rows whose `columns` no earlier row repeats exactly, in order (a digest per row: the rows
    themselves are not kept)."""
    seen: set[bytes] = set()
    keep = []
    for index, row in enumerate(table.select_columns(list(columns))):
        digest = hashlib.blake2b(repr([row[name] for name in columns]).encode(), digest_size=16).digest()
        if digest not in seen:
            seen.add(digest)
            keep.append(index)
    return keep


def without_repeats(table: Any, columns: Sequence[str]) -> tuple[Any, int]:
    """The table without rows that repeat an earlier one, and how many were dropped."""
    keep = first_occurrences(table, columns)
    return (table if len(keep) == len(table) else table.select(keep)), len(table) - len(keep)


def shard(table: Any, count: int | None, index: int | None) -> Any:
    """Shard `index` of `count` (datasets' contiguous shards), or the table when no shard is asked for."""
    return table if count is None or index is None else table.shard(num_shards=count, index=index, contiguous=True)
