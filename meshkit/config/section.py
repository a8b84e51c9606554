"""What every config section shares: frozen, no unknown keys; and the bounded duration field."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SECONDS = 10_000_000.0  # ~115 days: a bound that timedelta and the backends' millisecond clocks can hold


def seconds(default: float, description: str) -> Any:
    """A duration field: positive, finite and bounded (inf or 1e300 would overflow the C++ timeouts)."""
    return Field(default, gt=0, le=MAX_SECONDS, allow_inf_nan=False, description=description)


class Section(BaseModel):
    """Base of every config section: immutable, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _none_as_a_choice(cls, data: Any) -> Any:
        """`mode=none` from the command line or the environment reads as null; where "none" is one of the
        field's choices (activation_checkpointing.mode, sharding.offload, ...) it means that choice."""
        if not isinstance(data, dict):
            return data
        fixed = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if value is None and field is not None and "none" in get_args(field.annotation):
                fixed[name] = "none"
        return fixed
