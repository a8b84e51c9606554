"""What every config section shares: frozen, no unknown keys; and the bounded duration field."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

# YAML 1.1 reads on/off, yes/no and true/false as booleans: the word a key's choices hold, for each boolean
TRUE_WORDS, FALSE_WORDS = ("on", "yes", "true"), ("off", "no", "false", "none")
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
        field's choices (activation_checkpointing.mode, sharding.offload, ...) it means that choice. A boolean
        where the field chooses among words (`fused_loss: off`, `precision: no`: YAML 1.1 reads them as false)
        means the word the user wrote: on/yes/true for true, off/no/false (else none) for false, whichever the
        field holds."""
        if not isinstance(data, dict):
            return data
        fixed = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if value is None and field is not None and "none" in get_args(field.annotation):
                fixed[name] = "none"
            elif isinstance(value, bool) and field is not None:
                words = word_choices(field.annotation)
                said = next((word for word in (TRUE_WORDS if value else FALSE_WORDS) if word in words), None)
                fixed[name] = said if said is not None else value
        return fixed


def word_choices(annotation: Any) -> tuple[str, ...]:
    """The words a field chooses from (`Literal["auto", "on", "off"]`, also inside `X | None`); none where a
    boolean is itself one of its values (then YAML's true/false are meant as they are)."""
    if annotation is bool:
        return ()
    if get_origin(annotation) is Literal:
        return tuple(arg for arg in get_args(annotation) if isinstance(arg, str))
    args = get_args(annotation)
    if bool in args:
        return ()
    return tuple(word for arg in args for word in word_choices(arg))
