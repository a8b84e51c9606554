"""What every config section shares: frozen, no unknown keys; and the bounded duration field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_SECONDS = 10_000_000.0  # ~115 days: a bound that timedelta and the backends' millisecond clocks can hold


def seconds(default: float, description: str) -> Any:
    """A duration field: positive, finite and bounded (inf or 1e300 would overflow the C++ timeouts)."""
    return Field(default, gt=0, le=MAX_SECONDS, allow_inf_nan=False, description=description)


class Section(BaseModel):
    """Base of every config section: immutable, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
