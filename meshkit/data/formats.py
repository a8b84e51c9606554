"""Instruction data formats (as Axolotl names them) -> token ids and labels, prompt tokens masked.

- `alpaca`: `instruction`, optional `input`, `output`; the prompt is the Alpaca template (variants: `alpaca:chat`
  USER/ASSISTANT, `alpaca:phi` Phi's turn markers, `alpaca_w_system` with the record's `system`), the answer
  `output`. A user-defined type (a mapping: `field_instruction`, `format`, ...) names its own fields and formats.
- `chat_template` (and `sharegpt`): turns of `{role, content}` (field names mapped by `field_messages`,
  `message_property_mappings`, `roles`) rendered with the chat template; the turns of `roles_to_train`
  (default: assistant) are trained on, and the EOS tokens `train_on_eos` says.
- `completion`: `text` (or `field`); every token is trained on.
- `input_output`: `segments` of `{text, label}`; the segments with `label: true` are trained on.

Without `train_on_inputs` the prompt tokens get label -100 (no loss). `meshkit.data.tokenized` runs a `Formatter`
over whole datasets; a record's `where` (file and line) is formatted only into error messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshkit.data.chat_templates import chat_template
from meshkit.data.dataset_entry import CustomPrompt, DatasetEntry
from meshkit.data.instruction_types import INSTRUCTION_TYPES
from meshkit.data.jsonl import DataFormatError, Within, record_field
from meshkit.data.messages import CharSpans, Conversation, conversation
from meshkit.data.mistral_chat import conversation_sample, is_mistral_common
from meshkit.data.turn_regions import closing_text, message_regions
from meshkit.training.loss import IGNORE_INDEX

Piece = tuple[str, "bool | CharSpans"]  # (text, trained: whole, or the trained character spans of the text)

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_VARIANT_PROMPTS = {  # (with input, without input)
    "alpaca:chat": ("USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:"),
    "alpaca:phi": (
        "<|user|>\n{instruction}\n{input}<|end|>\n<|assistant|>\n",
        "<|user|>\n{instruction}<|end|>\n<|assistant|>\n",
    ),
}
ALPACA_VARIANT_PROMPTS["alpaca_chat"] = ALPACA_VARIANT_PROMPTS["alpaca:chat"]
ALPACA_VARIANT_PROMPTS["alpaca_phi"] = ALPACA_VARIANT_PROMPTS["alpaca:phi"]


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    where: object,
    generation_prompt: bool,
    template: str | None,
    template_kwargs: dict[str, Any],
    tools: list[Any] | None = None,
) -> str:
    """`messages` as the chat template writes them (text), with the record's `tools`; a template that rejects them
    is one line naming the record."""
    if not messages:
        return ""
    try:
        return str(
            tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                chat_template=template,
                **template_kwargs,
            )
        )
    except Exception as err:  # jinja raises its own errors for templates that reject a conversation
        raise DataFormatError(f"{where}: the chat template rejects this conversation: {err}") from None


def end_of_turn_ids(tokenizer: Any, tokens: Sequence[str] | None) -> set[int]:
    """Token ids of Axolotl's `eot_tokens` (each must be one token of the tokenizer); without them — or with
    Mistral's own tokenizer, which ends every turn with its end of sequence (Axolotl reads no eot_tokens there) —
    the EOS."""
    if not tokens or is_mistral_common(tokenizer):
        return {tokenizer.eos_token_id} - {None}
    ids = set()
    for token in tokens:
        encoded = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise DataFormatError(
                f"eot_tokens: {token!r} is {len(encoded)} tokens of this tokenizer, not one: add it with tokens: "
                "(or special_tokens:), or remove it from eot_tokens"
            )
        ids.add(encoded[0])
    return ids


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]  # IGNORE_INDEX where the token does not count


class Formatter:
    """Turns the records of one dataset entry into `TokenizedSample`s with one tokenizer."""

    def __init__(self, tokenizer: Any, train_on_inputs: bool, entry: DatasetEntry | None = None, **chat: Any) -> None:
        self.tokenizer = tokenizer
        self.train_on_inputs = train_on_inputs
        self.entry = entry
        self.default_system_message: str | None = chat.get("default_system_message")
        self.eot_ids = end_of_turn_ids(tokenizer, chat.get("eot_tokens"))
        self.template_kwargs: dict[str, Any] = dict(chat.get("chat_template_kwargs") or {})
        self.template: str | None = None
        if entry is not None and (entry.chat_template or entry.chat_template_jinja):
            self.template = chat_template(entry.chat_template, entry.chat_template_jinja, tokenizer)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _sample(self, pieces: Sequence[tuple[str, bool | CharSpans]], bos: bool, eos: bool) -> TokenizedSample:
        """`pieces`: (text, trained) in order; the labels copy the ids of trained pieces — or, where `trained` is
        character spans of the text, of the tokens overlapping one."""
        ids: list[int] = []
        labels: list[int] = []
        specials = self.tokenizer
        if bos and specials.bos_token_id is not None:
            ids.append(specials.bos_token_id)
            labels.append(IGNORE_INDEX)
        for text, trained in pieces:
            if isinstance(trained, tuple) and not self.train_on_inputs:
                piece, piece_labels = self._spans(text, trained)
                ids.extend(piece)
                labels.extend(piece_labels)
                continue
            piece = self._ids(text)
            ids.extend(piece)
            labels.extend(piece if trained or self.train_on_inputs else [IGNORE_INDEX] * len(piece))
        if eos and specials.eos_token_id is not None:
            ids.append(specials.eos_token_id)
            labels.append(specials.eos_token_id)
        return TokenizedSample(tuple(ids), tuple(labels))

    def _spans(self, text: str, spans: CharSpans) -> tuple[list[int], list[int]]:
        """`text`'s ids, and labels copying those of the tokens that overlap a span (Axolotl widens a span to the
        tokens it touches: a token runs up to the next one's first character)."""
        if not getattr(self.tokenizer, "is_fast", False):
            raise DataFormatError("message_field_training_detail needs a fast tokenizer (character offsets)")
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        piece, offsets = list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]
        ends = [*(start - 1 for start in offsets[1:]), len(text) - 1]
        labels = [
            token if any(begin <= end and start <= last for begin, last in spans) else IGNORE_INDEX
            for token, start, end in zip(piece, offsets, ends, strict=True)
        ]
        return piece, labels

    def alpaca(self, record: dict[str, Any], where: object, variant: str = "alpaca") -> TokenizedSample:
        instruction = record_field(record, "instruction", where)
        extra = record_field(record, "input", where, required=False) or ""
        output = record_field(record, "output", where)
        if variant in ALPACA_VARIANT_PROMPTS:
            with_input, without = ALPACA_VARIANT_PROMPTS[variant]
            prompt = (with_input if extra else without).format(instruction=instruction, input=extra)
        else:
            template = ALPACA_WITH_INPUT if extra else ALPACA_NO_INPUT
            prompt = template.format(instruction=instruction, input=extra)
            system = record_field(record, "system", where, required=False) if variant == "alpaca_w_system" else None
            if system:
                prompt = f"{system}\n\n" + prompt.split("\n\n", 1)[1]
        return self._sample([(prompt, False), (output, True)], bos=True, eos=True)

    def custom(self, record: dict[str, Any], where: object, spec: CustomPrompt) -> TokenizedSample:
        instruction = record_field(record, spec.field_instruction, where)
        extra = record_field(record, spec.field_input, where, required=False) or ""
        output = record_field(record, spec.field_output, where)
        system = record_field(record, spec.field_system, where, required=False) or spec.system_prompt
        prompt = (spec.format if extra else spec.no_input_format).format(instruction=instruction, input=extra)
        if system:
            prompt = spec.system_format.format(system=system) + prompt
        return self._sample([(prompt, False), (output, True)], bos=True, eos=True)

    def completion(self, record: dict[str, Any], where: object) -> TokenizedSample:
        text = record_field(record, (self.entry.field if self.entry else None) or "text", where)
        return self._sample([(text, True)], bos=True, eos=True)

    def pretrain(self, record: dict[str, Any], where: object) -> TokenizedSample:
        """Plain text (`text_column`, default text); every token trained."""
        text = record_field(record, (self.entry.text_column if self.entry else None) or "text", where)
        return self._sample([(text, True)], bos=True, eos=True)

    def tokenized(self, record: dict[str, Any], where: object) -> TokenizedSample:
        """A record tokenized already (an entry without `type`, as Axolotl reads it): `input_ids`, and `labels`
        (-100 where a token does not count) or every token trained; `attention_mask` is not read."""
        if "input_ids" not in record:
            raise DataFormatError(
                f"{where}: an entry without type reads records tokenized already (input_ids), and this one has "
                f"{sorted(record)[:6]}: set the entry's type (alpaca, chat_template, completion, ...)"
            )
        ids = record_field(record, "input_ids", where, kind=list)
        labels = record.get("labels")
        labels = ids if labels is None else labels
        if not isinstance(labels, list) or len(labels) != len(ids):
            raise DataFormatError(f"{where}: labels must be a list as long as input_ids ({len(ids)} tokens)")
        if not all(isinstance(token, int) for token in (*ids, *labels)):
            raise DataFormatError(f"{where}: input_ids and labels must be lists of token ids (integers)")
        return TokenizedSample(tuple(ids), tuple(labels))

    def input_output(self, record: dict[str, Any], where: object) -> TokenizedSample:
        segments = record_field(record, "segments", where, kind=list)
        pieces = []
        for index, segment in enumerate(segments):
            place = Within(where, f"segments[{index}]")
            if not isinstance(segment, dict):
                raise DataFormatError(f"{place} must be an object with 'text' and 'label'")
            pieces.append((record_field(segment, "text", place), bool(segment.get("label", True))))
        return self._sample(pieces, bos=False, eos=False)

    def chat_template(self, record: dict[str, Any], where: object, sharegpt: bool = False) -> TokenizedSample:
        entry = self.entry or DatasetEntry(path=".", type="chat_template")
        chat = conversation(record, entry, where, sharegpt, self.default_system_message)
        messages = chat.messages
        trained_roles = set(entry.roles_to_train or ("assistant",))
        trains = [
            own if own is not None else message["role"] in trained_roles
            for message, own in zip(messages, chat.trains, strict=True)
        ]
        if is_mistral_common(self.tokenizer):  # (encoded by mistral-common itself: no template text to read)
            ids, labels = conversation_sample(self.tokenizer, messages, trains, where)
            return self._ends(TokenizedSample(tuple(ids), tuple(ids if self.train_on_inputs else labels)), entry)
        if (self.template or self.tokenizer.chat_template) is None:
            raise DataFormatError(
                f"{where}: type chat_template needs a chat template; the base model's tokenizer has none: set "
                "chat_template (e.g. chatml, llama3)"
            )
        pieces = self._turn_by_turn(chat, trains, where)
        if pieces is None:  # (a template that renders an earlier turn differently once later turns exist)
            pieces = self._regions_of_the_whole(chat, trains, entry, where)
        return self._ends(self._sample([p for p in pieces if p[0]], bos=False, eos=False), entry)

    def _ends(self, sample: TokenizedSample, entry: DatasetEntry) -> TokenizedSample:
        """`train_on_eos` / `train_on_eot` over a chat sample."""
        on_eos = entry.train_on_eos
        sample = self._train_on_ends(sample, {self.tokenizer.eos_token_id} - {None}, on_eos)
        on_eot = entry.train_on_eot or on_eos  # (Axolotl: train_on_eos when unset)
        return self._train_on_ends(sample, self.eot_ids - {self.tokenizer.eos_token_id}, on_eot)

    def _turn_by_turn(self, chat: Conversation, trains: list[bool], where: object) -> list[Piece] | None:
        """Each turn as what rendering one more message adds (its generation prompt untrained); None where the
        template changes earlier text when a message comes."""
        pieces: list[Piece] = []
        rendered = ""
        for index, message in enumerate(chat.messages):
            before = self._render(chat.messages[:index], where, message["role"] == "assistant", chat.tools)
            after = self._render(chat.messages[: index + 1], where, False, chat.tools)
            if not (before.startswith(rendered) and after.startswith(before)):
                return None
            turn, detail = after[len(before) :], chat.details[index]
            pieces.append((before[len(rendered) :], False))
            spans = _turn_spans(turn, message, detail, where) if trains[index] and detail is not None else None
            pieces.append((turn, spans if spans is not None else trains[index]))
            rendered = after
        return pieces

    def _regions_of_the_whole(
        self, chat: Conversation, trains: list[bool], entry: DatasetEntry, where: object
    ) -> list[Piece]:
        """The conversation rendered whole, each message's own text found in it (`meshkit.data.turn_regions`)."""
        own_keys = ("content", entry.template_thinking_key or "reasoning_content")
        whole, regions = message_regions(lambda turns: self._render(turns, where, False, chat.tools), chat.messages,
                                         own_keys)  # fmt: skip
        pieces: list[Piece] = []
        closings: dict[str, str] = {}
        cursor = 0
        for index, (start, end) in enumerate(regions):
            if end <= start:
                continue
            role = chat.messages[index]["role"]
            if role not in closings:
                closings[role] = closing_text(lambda turns: self._render(turns, where, False), role)
            closing = closings[role]
            if closing and whole.startswith(closing, end):  # the turn's end (its end-of-turn marks) is the turn's
                end += len(closing)
            if start < cursor:
                raise DataFormatError(
                    f"{where}: the chat template's rendering of message {index} overlaps the one before; use type "
                    "completion with the rendered text instead"
                )
            region, detail = whole[start:end], chat.details[index]
            spans = None
            if trains[index] and detail is not None:
                spans = _turn_spans(region, chat.messages[index], detail, where)
            pieces += [(whole[cursor:start], False), (region, spans if spans is not None else trains[index])]
            cursor = end
        return [*pieces, (whole[cursor:], False)]

    def _train_on_ends(self, sample: TokenizedSample, ends: set[int], mode: str | None) -> TokenizedSample:
        """Which of the `ends` tokens (EOS, or end-of-turn tokens) train: `turn` (default): those ending a trained
        turn; `all`: every one; `last`: only the last one; `none`: none."""
        if mode in (None, "turn") or not ends:
            return sample
        labels = list(sample.labels)
        positions = [i for i, token in enumerate(sample.input_ids) if token in ends]
        for i in positions:
            trained = mode == "all" or (mode == "last" and i == positions[-1])
            labels[i] = sample.input_ids[i] if trained else IGNORE_INDEX
        return TokenizedSample(sample.input_ids, tuple(labels))

    def _render(
        self, messages: list[dict[str, Any]], where: object, generation_prompt: bool, tools: list[Any] | None = None
    ) -> str:
        return render_chat(
            self.tokenizer, messages, where, generation_prompt, self.template, self.template_kwargs, tools
        )

    def convert(self, record: dict[str, Any], where: object, kind: Any) -> TokenizedSample:
        if kind is None:
            return self.tokenized(record, where)
        if isinstance(kind, CustomPrompt):
            return self.custom(record, where, kind)
        if not isinstance(kind, str):
            raise DataFormatError(f"{where}: a preference data type needs rl: (dpo, ipo, kto, orpo, simpo)")
        kind = kind.split(".", 1)[0]  # Axolotl's `alpaca_w_system.load_open_orca` form
        if kind.startswith("alpaca"):
            return self.alpaca(record, where, kind)
        if kind in ("chat_template", "sharegpt"):
            return self.chat_template(record, where, sharegpt=kind == "sharegpt")
        if kind in INSTRUCTION_TYPES:
            prompt, response = INSTRUCTION_TYPES[kind].prompt_and_response(record, where)
            return self._sample([(prompt, False), (response, True)], bos=True, eos=True)
        return getattr(self, kind)(record, where)


def _turn_spans(turn: str, message: dict[str, Any], content_spans: CharSpans, where: object) -> CharSpans:
    """A turn's trained character spans: the content's spans (`message_field_training_detail`) moved to where the
    content sits in the rendered turn, and the turn's end after the content (its end-of-turn marks) as trained."""
    content = str(message.get("content", ""))
    start = turn.find(content) if content else -1
    if start < 0:
        raise DataFormatError(
            f"{where}: message_field_training_detail: the chat template does not write the turn's content as is"
        )
    spans = tuple((start + begin, start + end) for begin, end in content_spans)
    closing = start + len(content)
    return spans + (((closing, len(turn) - 1),) if closing < len(turn) else ())
