"""A chat record's turns as its chat template reads them, by Axolotl's `chat_template` dataset keys.

- `field_messages` holds the turns; `message_property_mappings` (older: `message_field_role` / `_content`) maps a
  turn's keys to the template's properties — every mapped property a turn has is handed to the template (tool calls,
  names, ...), not only role and content; `roles` maps role names.
- Reasoning: a turn's `field_thinking` (default `reasoning_content`) becomes the template's `template_thinking_key`
  (default `reasoning_content`) where no `message_property_mappings` are given, as Axolotl does; `split_thinking`
  moves `<think>…</think>` (or `<reasoning>`, `<|begin_of_thought|>`) out of an assistant's content into it.
- `field_system` (default `system`): a record's system text becomes the first turn unless the turns begin with one;
  `field_tools` (default `tools`): the tool definitions handed to the template (JSON text is parsed).
- `message_field_training` names a turn's key that says whether the turn trains (over `roles_to_train`);
  `message_field_training_detail` one holding `[{begin_offset, end_offset, train}]` character spans of the content
  (inclusive ends): only the tokens overlapping a trained span train.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshkit.data.dataset_entry import DatasetEntry
from meshkit.data.jsonl import DataFormatError, Within, record_field

THINKING_MARKS = (
    ("<think>", "</think>"),
    ("<reasoning>", "</reasoning>"),
    ("<|begin_of_thought|>", "<|end_of_thought|>"),
)
SOLUTION_MARKS = ("<|begin_of_solution|>", "<|end_of_solution|>")
CharSpans = tuple[tuple[int, int], ...]  # (begin, end) character ranges, inclusive ends


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]  # what the template reads: role, content and every other mapped property
    trains: list[bool | None]  # per turn: the record's own say (message_field_training); None: by its role
    details: list[CharSpans | None]  # per turn: the content's trained character spans; None: the whole turn
    tools: list[Any] | None = None


def property_keys(entry: DatasetEntry) -> dict[str, str]:
    """Template property -> the turn's key."""
    mapping = entry.mappings()
    if not entry.message_property_mappings:
        thinking = entry.template_thinking_key or "reasoning_content"
        mapping.setdefault(thinking, entry.field_thinking or "reasoning_content")
    return mapping


def conversation(
    record: dict[str, Any], entry: DatasetEntry, where: object, sharegpt: bool, default_system: str | None = None
) -> Conversation:
    key = entry.field_messages or ("conversations" if sharegpt and "conversations" in record else "messages")
    mapping = property_keys(entry)
    if sharegpt and not entry.message_property_mappings and "from" in str(record.get(key)):
        mapping = {"role": "from", "content": "value"}
    roles = entry.role_names()
    messages: list[dict[str, Any]] = []
    trains: list[bool | None] = []
    details: list[CharSpans | None] = []
    for index, message in enumerate(record_field(record, key, where, kind=list)):
        place = Within(where, f"{key}[{index}]")
        if not isinstance(message, dict):
            raise DataFormatError(f"{place} must be an object with '{mapping['role']}' and '{mapping['content']}'")
        turn = {prop: message[name] for prop, name in mapping.items() if message.get(name) is not None}
        turn["role"] = roles.get(record_field(message, mapping["role"], place), message[mapping["role"]])
        if "content" not in turn and len(turn) == 1:
            record_field(message, mapping["content"], place)  # (raises: a turn with nothing in it)
        if entry.split_thinking and turn["role"] == "assistant" and isinstance(turn.get("content"), str):
            turn = _split_thinking(turn, entry.template_thinking_key or "reasoning_content")
        if turn["role"] == "system" and entry.drop_system_message:
            continue
        messages.append(turn)
        trains.append(_train_flag(message, entry.message_field_training, place))
        details.append(_detail(message, entry.message_field_training_detail, turn.get("content"), place))
    system = record.get(entry.field_system or "system")
    begins_with_system = bool(messages) and messages[0]["role"] == "system"
    if isinstance(system, str) and system and not begins_with_system and not entry.drop_system_message:
        messages.insert(0, {"role": "system", "content": system})
        trains.insert(0, None)
        details.insert(0, None)
    if default_system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": default_system})
        trains.insert(0, None)
        details.insert(0, None)
    return Conversation(messages, trains, details, _tools(record, entry.field_tools or "tools", where))


def _split_thinking(turn: dict[str, Any], thinking_key: str) -> dict[str, Any]:
    content = turn["content"]
    for opening, closing in THINKING_MARKS:
        start, end = content.find(opening), content.find(closing)
        if start < 0 or end < start:
            continue
        rest = content[end + len(closing) :].lstrip()
        first, last = rest.find(SOLUTION_MARKS[0]), rest.find(SOLUTION_MARKS[1])
        if 0 <= first < last:
            rest = rest[first + len(SOLUTION_MARKS[0]) : last].strip()
        return {**turn, thinking_key: content[start + len(opening) : end].strip(), "content": rest}
    return turn


def _train_flag(message: dict[str, Any], key: str | None, place: object) -> bool | None:
    if key is None or message.get(key) is None:
        return None
    value = message[key]
    if not isinstance(value, bool):
        raise DataFormatError(f"{place}: '{key}' (message_field_training) must be true or false, not {value!r}")
    return value


def _detail(message: dict[str, Any], key: str | None, content: Any, place: object) -> CharSpans | None:
    if key is None or message.get(key) is None:
        return None
    if not isinstance(content, str):
        raise DataFormatError(f"{place}: '{key}' (message_field_training_detail) needs the turn's content as text")
    spans = []
    for item in message[key]:
        try:
            begin, end, train = int(item["begin_offset"]), int(item["end_offset"]), bool(item["train"])
        except (KeyError, TypeError, ValueError):
            raise DataFormatError(
                f"{place}: '{key}' holds {{begin_offset, end_offset, train}} items; found {item!r}"
            ) from None
        if train:
            spans.append((begin, end))
    return tuple(spans)


def _tools(record: dict[str, Any], key: str, where: object) -> list[Any] | None:
    tools = record.get(key)
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{where}: '{key}' (field_tools) is text but not JSON: {err}") from None
    if not isinstance(tools, list):
        raise DataFormatError(f"{where}: '{key}' (field_tools) must be a list of tool definitions")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("parameters"), str):
            function["parameters"] = json.loads(function["parameters"])
    return tools
