"""JSON Lines records, with errors that name the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshkit.core.errors import MeshkitError, brief


class DataFormatError(MeshkitError):
    """A dataset file or record that cannot be read; the message names the file, the line and the field."""


class Within:
    """A place inside a record (`<record's place>: messages[3]`), formatted only when an error message names it: a
    record's own place may cost a read of its file, which every record of a dataset must not pay."""

    def __init__(self, where: object, part: str) -> None:
        self.where, self.part = where, part

    def __str__(self) -> str:
        return f"{self.where}: {self.part}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line; each record must be a JSON object."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataFormatError(f"dataset '{file}' does not exist: fix datasets[].path")
    with file.open(encoding="utf-8") as handle:
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataFormatError(
                        f"{file}:{number}: not valid JSON ({err.msg} at column {err.colno})"
                    ) from None
                if not isinstance(record, dict):
                    raise DataFormatError(
                        f"{file}:{number}: a record must be a JSON object, got {type(record).__name__}"
                    )
                yield number, record
        except UnicodeDecodeError as err:
            raise DataFormatError(f"{file}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def record_field(
    record: dict[str, Any], name: str, where: object, *, kind: type | tuple[type, ...] = str, required: bool = True
) -> Any:
    """`record[name]`, checked: a missing or mistyped field is one line naming it and the record's place."""
    if name not in record or record[name] is None:
        if not required:
            return None
        raise DataFormatError(f"{where}: the record has no '{name}' field (it has {sorted(record)[:8]})")
    value = record[name]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise DataFormatError(f"{where}: '{name}' must be a {names}, got {brief(value, 40)}")
    return value
