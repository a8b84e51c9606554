"""Instruction data formats (as Axolotl names them) -> token ids and labels, prompt tokens masked.

- `alpaca`: `instruction`, optional `input`, `output`; the prompt is the Alpaca template, the answer `output`.
- `chat_template`: `messages` of `{role, content}`, rendered with the tokenizer's chat template; only the
  assistant turns are trained on.
- `completion`: `text`; every token is trained on.

Without `train_on_inputs` the prompt tokens get label -100 (no loss). A sample longer than `sequence_len`
or with no token to train on is dropped and counted (as Axolotl does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshkit.data.jsonl import DataFormatError, read_jsonl, record_field
from meshkit.loss import IGNORE_INDEX

DatasetType = Literal["alpaca", "chat_template", "completion"]
DATASET_TYPES: tuple[str, ...] = ("alpaca", "chat_template", "completion")

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]  # IGNORE_INDEX where the token does not count


@dataclass
class LoadReport:
    """What became of the records: kept, dropped as too long, dropped with nothing to train on."""

    kept: int = 0
    too_long: int = 0
    nothing_to_train: int = 0
    per_file: dict[str, int] = field(default_factory=dict)


class Formatter:
    """Turns records of one dataset type into `TokenizedSample`s with one tokenizer."""

    def __init__(self, tokenizer: Any, train_on_inputs: bool) -> None:
        self.tokenizer = tokenizer
        self.train_on_inputs = train_on_inputs

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _sample(self, pieces: Sequence[tuple[str, bool]], bos: bool, eos: bool) -> TokenizedSample:
        """`pieces`: (text, trained) in order; the labels copy the ids of trained pieces."""
        ids: list[int] = []
        labels: list[int] = []
        specials = self.tokenizer
        if bos and specials.bos_token_id is not None:
            ids.append(specials.bos_token_id)
            labels.append(IGNORE_INDEX)
        for text, trained in pieces:
            piece = self._ids(text)
            ids.extend(piece)
            labels.extend(piece if trained or self.train_on_inputs else [IGNORE_INDEX] * len(piece))
        if eos and specials.eos_token_id is not None:
            ids.append(specials.eos_token_id)
            labels.append(specials.eos_token_id)
        return TokenizedSample(tuple(ids), tuple(labels))

    def alpaca(self, record: dict[str, Any], where: str) -> TokenizedSample:
        instruction = record_field(record, "instruction", where)
        extra = record_field(record, "input", where, required=False) or ""
        output = record_field(record, "output", where)
        template = ALPACA_WITH_INPUT if extra else ALPACA_NO_INPUT
        prompt = template.format(instruction=instruction, input=extra)
        return self._sample([(prompt, False), (output, True)], bos=True, eos=True)

    def completion(self, record: dict[str, Any], where: str) -> TokenizedSample:
        text = record_field(record, "text", where)
        return self._sample([(text, True)], bos=True, eos=True)

    def chat_template(self, record: dict[str, Any], where: str) -> TokenizedSample:
        messages = record_field(record, "messages", where, kind=list)
        for index, message in enumerate(messages):
            place = f"{where}: messages[{index}]"
            if not isinstance(message, dict):
                raise DataFormatError(f"{place} must be an object with 'role' and 'content'")
            record_field(message, "role", place)
            record_field(message, "content", place)
        if self.tokenizer.chat_template is None:
            raise DataFormatError(
                f"{where}: type chat_template needs a tokenizer with a chat template; the base model's has none"
            )
        pieces: list[tuple[str, bool]] = []
        rendered = ""
        for index, message in enumerate(messages):
            before = self._render(messages[:index], where, generation_prompt=message["role"] == "assistant")
            after = self._render(messages[: index + 1], where, generation_prompt=False)
            if not (before.startswith(rendered) and after.startswith(before)):
                raise DataFormatError(
                    f"{where}: the chat template does not render the conversation turn by turn (message {index} "
                    "changes earlier text); use type completion with the rendered text instead"
                )
            pieces.append((before[len(rendered) :], False))
            pieces.append((after[len(before) :], message["role"] == "assistant"))
            rendered = after
        return self._sample([p for p in pieces if p[0]], bos=False, eos=False)

    def _render(self, messages: list[dict[str, Any]], where: str, generation_prompt: bool) -> str:
        if not messages:
            return ""
        try:
            return str(
                self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            )
        except Exception as err:  # jinja raises its own errors for templates that reject a conversation
            raise DataFormatError(f"{where}: the chat template rejects this conversation: {err}") from None


def load_samples(
    datasets: Sequence[tuple[Path, str]], tokenizer: Any, *, sequence_len: int, train_on_inputs: bool
) -> tuple[list[TokenizedSample], LoadReport]:
    """Every dataset's records, tokenized, in file order; over-long and untrainable samples are dropped."""
    formatter = Formatter(tokenizer, train_on_inputs)
    samples: list[TokenizedSample] = []
    report = LoadReport()
    for path, kind in datasets:
        if kind not in DATASET_TYPES:
            raise DataFormatError(f"dataset '{path}': type '{kind}' is not one of {', '.join(DATASET_TYPES)}")
        convert = getattr(formatter, kind)
        count = 0
        for number, record in read_jsonl(path):
            sample = convert(record, f"{path}:{number}")
            if len(sample.input_ids) > sequence_len:
                report.too_long += 1
            elif all(label == IGNORE_INDEX for label in sample.labels[1:]):
                report.nothing_to_train += 1
            else:
                samples.append(sample)
                count += 1
        report.per_file[str(path)] = count
    report.kept = len(samples)
    return samples, report
