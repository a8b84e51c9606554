"""The rows of Axolotl's key table: what meshkit does with one key (see `keys`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from meshkit.config.importing.axolotl import layout

Kind = Literal["honoured", "noted", "refused"]
Reader = Callable[[str, Any, layout.Sink], None]


@dataclass(frozen=True)
class KeyRule:
    kind: Kind
    effect: str  # what meshkit does with the key (the words of the docs' key table)
    to: str | None = None  # meshkit key, "recipe" (the recipe setting of the same name) or "recipe.<name>"
    convert: Callable[[Any], Any] | None = None  # the key's value -> the target's; None from it sets nothing
    reader: Reader | None = None  # keys that set several settings
    group: str = ""
    off: tuple[Any, ...] = ()  # further values that ask for nothing (a size of 1)


Rules = list[tuple[str, tuple[str, ...], KeyRule]]


def add_rule(rules: Rules, group: str, names: tuple[str, ...] | str, rule: KeyRule) -> None:
    rules.append((group, (names,) if isinstance(names, str) else names, KeyRule(**{**rule.__dict__, "group": group})))


def honoured(
    effect: str, to: str | None = "recipe", convert: Callable[[Any], Any] | None = None, reader: Reader | None = None
) -> KeyRule:
    return KeyRule("honoured", effect, to if reader is None else None, convert, reader)


def noted(effect: str) -> KeyRule:
    return KeyRule("noted", effect)


def refused(effect: str) -> KeyRule:
    return KeyRule("refused", effect)
