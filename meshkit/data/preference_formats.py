"""Preference records (as Axolotl names their types) -> prompt and completion texts, before tokenizing.

Paired (DPO, IPO, ORPO, SimPO): a record becomes (prompt, chosen, rejected); unpaired (KTO): (prompt, completion,
desirable). The types:
- `chat_template.default`: `field_messages` (the conversation so far; a string is one user turn), `field_chosen` /
  `field_rejected` (a reply: a string, a message, or a conversation whose last message is the reply), rendered with
  the chat template; `message_property_mappings` and `roles` map the record's names.
- `chat_template.argilla` / `chat_template.argilla_chat`: `chosen` and `rejected` are whole conversations; the
  prompt is every message but the chosen's last.
- `chatml.*` / `llama3.*` (`default`, `argilla_chat`, `icr`, `intel`, `prompt_pairs`, `ultra`; KTO's `argilla`,
  `argilla_chat`, `intel`, `prompt_pairs`, `ultra`): one user turn (and the record's `system`) in ChatML or Llama-3
  markup; each variant names the field holding the question.
- `zephyr.nectar`: ranked `answers`, the best chosen and the second best rejected.
- a mapping (Axolotl's `user_defined`): `field_prompt`, `field_system`, `field_chosen`, `field_rejected` (KTO:
  `field_completion`, `field_label`) and `prompt_format` / `chosen_format` / `rejected_format` /
  `completion_format`.
- `passthrough`: the record already holds `prompt`, `chosen`, `rejected` (KTO: `prompt`, `completion`, `label`).
- `bradley_terry.chat_template` (reward models): `system`, `input`, `chosen`, `rejected`, each reply rendered as a
  whole conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit.data.chat_templates import chat_template
from meshkit.data.dataset_entry import DatasetEntry, PreferencePrompt
from meshkit.data.formats import render_chat
from meshkit.data.jsonl import DataFormatError, record_field

PAIRED_TYPES = ("chat_template", "chatml", "llama3", "zephyr", "user_defined", "passthrough")
UNPAIRED_TYPES = ("chatml", "llama3", "user_defined", "passthrough")


@dataclass(frozen=True)
class PairText:
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class UnpairedText:
    prompt: str
    completion: str
    desirable: bool


_MARKUP = {  # family -> (system turn, user turn then the assistant's header, end of the assistant's turn)
    "chatml": (
        "<|im_start|>system\n{system}<|im_end|>\n",
        "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|>",
    ),
    "llama3": (
        "<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>",
        "<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    ),
}
_QUESTION_FIELD = {  # variant -> the field holding the user's turn
    "icr": "input",
    "intel": "question",
    "prompt_pairs": "prompt",
    "ultra": "prompt",
    "argilla": "instruction",
}


def _content(value: Any, index: int, where: object, name: str) -> str:
    """`value[index]['content']` of a conversation field."""
    if not isinstance(value, list) or len(value) <= index or not isinstance(value[index], dict):
        raise DataFormatError(f"{where}: '{name}' must be a conversation of at least {index + 1} messages")
    return str(record_field(value[index], "content", where))


def _default_question(record: dict[str, Any]) -> str:
    for name in ("prompt", "input", "question", "instruction"):
        if name in record:
            return name
    return "prompt"


class PreferenceFormatter:
    """Turns the records of one dataset entry into `PairText` / `UnpairedText` with one tokenizer (for the chat
    template types)."""

    def __init__(
        self, tokenizer: Any, entry: DatasetEntry, template: str | None = None, template_kwargs: Any = None
    ) -> None:
        self.tokenizer, self.entry = tokenizer, entry
        self.template = template
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        if entry.chat_template or entry.chat_template_jinja:
            self.template = chat_template(entry.chat_template, entry.chat_template_jinja, tokenizer)

    def pair(self, record: dict[str, Any], where: object) -> PairText:
        kind = self.entry.type
        if isinstance(kind, PreferencePrompt):
            return self._user_defined_pair(record, where, kind)
        if not isinstance(kind, str):
            raise DataFormatError(f"{where}: a user-defined preference type takes field_prompt, prompt_format, ...")
        family, _, variant = kind.partition(".")
        if family == "passthrough":
            return PairText(*(str(record_field(record, name, where)) for name in ("prompt", "chosen", "rejected")))
        if family == "chat_template":
            return self._chat_pair(record, where, variant or "default")
        if family == "zephyr":
            answers = sorted(record_field(record, "answers", where, kind=list), key=lambda answer: answer["rank"])
            if len(answers) < 2:
                raise DataFormatError(f"{where}: 'answers' needs at least two ranked answers")
            prompt = f"<|system|>\n</s>\n<|user|>\n{record_field(record, 'prompt', where)}</s>\n<|assistant|>\n"
            return PairText(prompt, str(answers[-1]["answer"]), str(answers[-2]["answer"]))
        return self._markup_pair(record, where, family, variant or "default")

    def unpaired(self, record: dict[str, Any], where: object) -> UnpairedText:
        kind = self.entry.type
        if isinstance(kind, PreferencePrompt):
            return self._user_defined_unpaired(record, where, kind)
        if not isinstance(kind, str):
            raise DataFormatError(f"{where}: a user-defined KTO type takes field_prompt, field_label, ...")
        family, _, variant = kind.partition(".")
        desirable = self._label(record, where, "label")
        if family == "passthrough":
            return UnpairedText(
                str(record_field(record, "prompt", where)), str(record_field(record, "completion", where)), desirable
            )
        if family not in _MARKUP:
            raise DataFormatError(
                f"{where}: KTO reads chatml.*, llama3.*, user_defined and passthrough data, not {kind}"
            )
        system_turn, user_turn, end = _MARKUP[family]
        if variant == "argilla_chat":
            conversation = record_field(record, "completion", where, kind=list)
            prompt = user_turn.format(prompt=_content(conversation, 0, where, "completion"))
            return UnpairedText(prompt, _content(conversation, 1, where, "completion") + end, desirable)
        question = _QUESTION_FIELD.get(variant, "prompt")
        prompt = self._markup_prompt(record, where, family, question)
        return UnpairedText(prompt, str(record_field(record, "completion", where)) + end, desirable)

    def reward_pair(self, record: dict[str, Any], where: object) -> tuple[str, bool, str, bool]:
        """A reward model's pair: (chosen text, rendered by a chat template?, rejected text, rendered?).
        `bradley_terry.chat_template`: the record's `system`, `input` and each reply as a conversation, rendered
        whole; the other pair types: prompt + reply."""
        kind = self.entry.type
        if isinstance(kind, str) and kind.split(".", 1)[0] == "bradley_terry":
            head = [{"role": "system", "content": record["system"]}] if record.get("system") else []
            head.append({"role": "user", "content": record_field(record, "input", where)})
            texts = [
                self._render([*head, {"role": "assistant", "content": record_field(record, name, where)}], where, False)
                for name in ("chosen", "rejected")
            ]
            return texts[0], True, texts[1], True
        text = self.pair(record, where)
        return text.prompt + text.chosen, False, text.prompt + text.rejected, False

    # ------------------------------------------------------------------ paired types
    def _markup_pair(self, record: dict[str, Any], where: object, family: str, variant: str) -> PairText:
        if family not in _MARKUP:
            known = ", ".join(PAIRED_TYPES)
            raise DataFormatError(f"{where}: '{self.entry.type}' is not a preference data type meshkit reads ({known})")
        end = _MARKUP[family][2]
        if variant == "argilla_chat":
            chosen, rejected = (record_field(record, name, where, kind=list) for name in ("chosen", "rejected"))
            prompt = _MARKUP[family][1].format(prompt=_content(chosen, 0, where, "chosen"))
            return PairText(
                prompt, _content(chosen, 1, where, "chosen") + end, _content(rejected, 1, where, "rejected") + end
            )
        question = _QUESTION_FIELD.get(variant) or _default_question(record)
        prompt = self._markup_prompt(record, where, family, question)
        if variant == "ultra":
            chosen_text = _content(record_field(record, "chosen", where, kind=list), 1, where, "chosen")
            rejected_text = _content(record_field(record, "rejected", where, kind=list), 1, where, "rejected")
        else:
            chosen_key = "chosen" if "chosen" in record or variant != "default" else "chosen_response"
            rejected_key = "rejected" if "rejected" in record or variant != "default" else "rejected_response"
            chosen_text = str(record_field(record, chosen_key, where))
            rejected_text = str(record_field(record, rejected_key, where))
        return PairText(prompt, chosen_text + end, rejected_text + end)

    def _markup_prompt(self, record: dict[str, Any], where: object, family: str, question: str) -> str:
        system_turn, user_turn, _ = _MARKUP[family]
        system = record.get("system")
        head = system_turn.format(system=system) if system else ""
        return head + user_turn.format(prompt=record_field(record, question, where))

    def _chat_pair(self, record: dict[str, Any], where: object, variant: str) -> PairText:
        entry = self.entry
        if self.template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise DataFormatError(
                f"{where}: type {entry.type} needs a chat template; the base model's tokenizer has none: set "
                "chat_template (e.g. chatml, llama3)"
            )
        mapping, roles = entry.mappings(), entry.role_names()

        def message(raw: dict[str, Any]) -> dict[str, Any]:
            role = raw[mapping["role"]]
            return {"role": roles.get(role, role), "content": raw[mapping["content"]]}

        if variant in ("argilla", "argilla_chat"):
            chosen = record_field(record, entry.field_chosen or "chosen", where, kind=list)
            rejected = record_field(record, entry.field_rejected or "rejected", where, kind=list)
            if len(chosen) < 2 or len(rejected) < 2:
                raise DataFormatError(f"{where}: 'chosen' and 'rejected' must be conversations ending in the reply")
            history = [message(m) for m in chosen[:-1]]
            return self._rendered(history, message(chosen[-1]), message(rejected[-1]), where)
        if variant != "default":
            raise DataFormatError(f"{where}: chat_template.{variant} is not a preference type (default, argilla)")
        conversation = record_field(record, entry.field_messages or "messages", where, kind=(list, str))
        if isinstance(conversation, str):
            conversation = [{mapping["role"]: "user", mapping["content"]: conversation}]
        history = [message(m) for m in conversation]
        replies = []
        for name in (entry.field_chosen or "chosen", entry.field_rejected or "rejected"):
            raw = record_field(record, name, where, kind=(str, dict, list))
            reply = {mapping["role"]: "assistant", mapping["content"]: raw} if isinstance(raw, str) else raw
            replies.append(message(reply[-1] if isinstance(reply, list) else reply))
        return self._rendered(history, replies[0], replies[1], where)

    def _rendered(
        self, history: list[dict[str, Any]], chosen: dict[str, Any], rejected: dict[str, Any], where: object
    ) -> PairText:
        """The prompt rendered with the generation prompt; each reply as the template renders it after a user turn,
        from its content on (what follows the prompt), trailing space trimmed."""
        prompt = self._render(history, where, generation_prompt=True)
        return PairText(prompt, self._reply(chosen, where), self._reply(rejected, where))

    def _reply(self, reply: dict[str, Any], where: object) -> str:
        text = self._render([{"role": "user", "content": "[[dummy_message]]"}, reply], where, generation_prompt=False)
        start = text.find(str(reply["content"]))
        return text[max(start, 0) :].rstrip()

    def _render(self, messages: list[dict[str, Any]], where: object, generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, where, generation_prompt, self.template, self.template_kwargs)

    # ------------------------------------------------------------------ user-defined
    def _user_defined_prompt(self, record: dict[str, Any], where: object, spec: PreferencePrompt) -> str:
        question = record_field(record, spec.field_prompt, where)
        if "{system}" in spec.prompt_format:
            return spec.prompt_format.format(system=record.get(spec.field_system) or "", prompt=question)
        return spec.prompt_format.format(prompt=question)

    def _user_defined_pair(self, record: dict[str, Any], where: object, spec: PreferencePrompt) -> PairText:
        return PairText(
            self._user_defined_prompt(record, where, spec),
            spec.chosen_format.format(chosen=record_field(record, spec.field_chosen, where)),
            spec.rejected_format.format(rejected=record_field(record, spec.field_rejected, where)),
        )

    def _user_defined_unpaired(self, record: dict[str, Any], where: object, spec: PreferencePrompt) -> UnpairedText:
        return UnpairedText(
            self._user_defined_prompt(record, where, spec),
            spec.completion_format.format(completion=record_field(record, spec.field_completion, where)),
            self._label(record, where, spec.field_label),
        )

    @staticmethod
    def _label(record: dict[str, Any], where: object, name: str) -> bool:
        value = record_field(record, name, where, kind=object)
        if value not in (True, False, 0, 1):
            raise DataFormatError(f"{where}: '{name}' must be true (desirable) or false, got {value!r}")
        return bool(value)
