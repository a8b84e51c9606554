"""The one base of meshkit's input errors: each message is one line naming what is wrong and what to change."""

import reprlib
from typing import Any

MAX_SHOWN = 80  # characters of a user's value quoted in an error message
MAX_MESSAGE = 600  # characters of a whole one-line error message


class MeshkitError(ValueError):
    """Bad input or wrong use. The command line prints these as one line (exit code 2), never a traceback."""


def brief(value: Any, limit: int = MAX_SHOWN) -> str:
    """`repr(value)`, bounded: nested containers are cut by depth and length before they are formatted, so a
    value quoted in an error never makes the error (or the time to build it) huge."""
    shortener = reprlib.Repr()
    shortener.maxlevel, shortener.maxdict, shortener.maxlist, shortener.maxtuple = 3, 4, 4, 4
    shortener.maxstring, shortener.maxother = limit, limit
    shown = shortener.repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """The first line of a message, bounded; what the command line prints for a user error. A long line
    loses its middle: the start says what is wrong, the end what to do."""
    lines = message.strip().splitlines()
    first = lines[0] if lines else message
    if len(first) <= limit:
        return first
    tail = limit // 4
    return f"{first[: limit - tail - 5]} ... {first[-tail:]}"
