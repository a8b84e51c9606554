"""Axolotl's further built-in instruction types: records with their own field names, written as an Alpaca-style
prompt (instruction, input) and a response — `jeopardy`, `oasst`, `gpteacher`, `summarizetldr`, `explainchoice`,
`concisechoice` — each with the fields and the prompt Axolotl's prompter for it writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshkit.data.jsonl import record_field

_INSTRUCT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
_INSTRUCT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
_ALPACA_SYSTEM = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
)
_ALPACA_SYSTEM_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
)
_ALPACA = (_ALPACA_SYSTEM + _INSTRUCT, _ALPACA_SYSTEM_NO_INPUT + _INSTRUCT_NO_INPUT)
_EXPLAIN = "Choose the answer that best answers the question. Explain your reasoning.\n\n\n"
_CONCISE = "Choose the answer that best answers the question. Be concise in your response.\n\n"
_TLDR = "USER: Summarize the following article as a TL;DR.\n{instruction}"

Fields = Callable[[dict[str, Any], object], tuple[str, str, str]]  # (instruction, input, response)


@dataclass(frozen=True)
class InstructionType:
    fields: Fields
    prompts: tuple[str, str]  # (with an input, without)

    def prompt_and_response(self, record: dict[str, Any], where: object) -> tuple[str, str]:
        instruction, extra, response = self.fields(record, where)
        with_input, without = self.prompts
        return (with_input if extra else without).format(instruction=instruction, input=extra), response


def _named(instruction: str, extra: str | None, response: str, prefix: str = "") -> Fields:
    def fields(record: dict[str, Any], where: object) -> tuple[str, str, str]:
        given = record_field(record, extra, where, required=False) if extra else ""
        return (
            record_field(record, instruction, where),
            given or "",
            prefix + record_field(record, response, where),
        )

    return fields


def _choices(record: dict[str, Any], where: object) -> tuple[str, str, str]:
    choices = record_field(record, "choices", where, kind=list)
    answer = (
        record.get("solution") if record.get("solution") is not None else record_field(record, "explanation", where)
    )
    return record_field(record, "question", where), "\n".join(f'- "{choice}"' for choice in choices), str(answer)


INSTRUCTION_TYPES: dict[str, InstructionType] = {
    "jeopardy": InstructionType(_named("question", "category", "answer", prefix="what is "), _ALPACA),
    "oasst": InstructionType(_named("INSTRUCTION", None, "RESPONSE"), _ALPACA),
    "gpteacher": InstructionType(_named("instruction", "input", "response"), _ALPACA),
    "summarizetldr": InstructionType(
        _named("article", None, "summary"), (_TLDR + "\n{input}\nASSISTANT:", _TLDR + "\nASSISTANT:")
    ),
    "explainchoice": InstructionType(_choices, (_EXPLAIN + _INSTRUCT, _EXPLAIN + _INSTRUCT_NO_INPUT)),
    "concisechoice": InstructionType(
        _choices, (_CONCISE + "USER: {instruction}\n{input}\nASSISTANT:", _CONCISE + "USER: {instruction}\nASSISTANT:")
    ),
}
