"""What an import found: meshkit settings with their origins, the keys meshkit does not take, and notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshkit.core.errors import MeshkitError


class ImportingError(MeshkitError):
    """A file that is neither an Accelerate nor a DeepSpeed config, or values that contradict each other."""


@dataclass
class Imported:
    values: dict[str, Any] = field(default_factory=dict)  # meshkit dotted key -> value
    origins: dict[str, str] = field(default_factory=dict)  # meshkit key -> the source key
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (source key, why meshkit does not take it)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, origin: str) -> None:
        if key in self.values and self.values[key] == value:  # two source keys agree (e.g. both offloads)
            origin = f"{self.origins[key]} + {origin}"
        self.values[key], self.origins[key] = value, origin

    def skip(self, origin: str, why: str) -> None:
        self.skipped.append((origin, why))
