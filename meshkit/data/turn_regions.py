"""Where each message of a conversation sits in its whole rendering, for chat templates that do not render turn by
turn.

Most templates render a conversation as the concatenation of its turns, so a turn is what rendering one more
message adds. Some render a turn differently once later turns exist: Qwen3's (and DeepSeek-R1's) templates write an
assistant turn's reasoning only after the last user message, so an earlier turn loses its `<think>` block when the
next question comes. For those the conversation is rendered once, whole, and each message's region is found by
rendering it again with that message's own text (content and reasoning) replaced: the characters that change are
the message's, as the template writes them in the whole conversation — what a model reading this conversation sees.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

Render = Callable[[list[dict[str, Any]]], str]
SENTINEL = "\x00"


def message_regions(render: Render, messages: list[dict[str, Any]], own_keys: tuple[str, ...]) -> tuple[str, list]:
    """(the whole rendering, each message's (start, end) characters in it); `own_keys`: the message fields that are
    its own text, content first (then its reasoning). A message that renders nothing of its own has an empty
    region."""
    whole = render(messages)
    regions: list[tuple[int, int]] = []
    for index, message in enumerate(messages):
        # content -> a character no template writes (a region ends where its text does, not inside a shared `<`);
        # the rest (reasoning) -> empty, so that what the template wraps it in (`<think>`) falls in the region
        blank = {key: SENTINEL if key == own_keys[0] else "" for key in own_keys if isinstance(message.get(key), str)}
        if not blank:
            regions.append((0, 0))
            continue
        without = render([*messages[:index], {**message, **blank}, *messages[index + 1 :]])
        start = _common_prefix(whole, without)
        end = len(whole) - _common_suffix(whole[start:], without[start:])
        regions.append((start, end) if end > start else (start, start))
    return whole, regions


def closing_text(render: Render, role: str) -> str:
    """What the template writes after a `role` message's own text to end its turn (ChatML: `<|im_end|>\n`): the
    text after it in a two-message conversation ending with one; empty where the template cannot say."""
    try:
        probe = render([{"role": "user", "content": "x"}, {"role": role, "content": SENTINEL}])
    except Exception:  # noqa: BLE001 - a template that rejects the probe just has no known closing
        return ""
    return probe.rsplit(SENTINEL, 1)[1] if SENTINEL in probe else ""


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _common_suffix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a[::-1], b[::-1]]))
