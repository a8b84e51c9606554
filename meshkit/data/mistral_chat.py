"""Conversations encoded by Mistral's own tokenizer (mistral-common, `tokenizer_use_mistral_common`): its control
tokens are ids, never text, so the conversation is encoded by the tokenizer itself — in fine-tuning mode, where a
conversation ends with an assistant turn — up to each assistant turn, and each turn's new tokens after the last
`[/INST]` are the answer (its end of sequence included)."""

from __future__ import annotations

from typing import Any

from meshkit.data.jsonl import DataFormatError
from meshkit.training.loss import IGNORE_INDEX


def is_mistral_common(tokenizer: Any) -> bool:
    return type(tokenizer).__name__ == "MistralCommonBackend"


def conversation_sample(
    tokenizer: Any, messages: list[dict[str, Any]], trains: list[bool], where: object
) -> tuple[list[int], list[int]]:
    """(ids, labels) of a conversation encoded by mistral-common: each assistant turn's tokens (its answer and end
    of sequence) trained where `trains` says, everything else not. Messages after the last assistant turn are left
    out (fine-tuning mode encodes conversations that end with one)."""
    answer_start = tokenizer.convert_tokens_to_ids("[/INST]")
    ids: list[int] = []
    labels: list[int] = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            encoded = list(tokenizer.apply_chat_template(messages[: index + 1], tokenize=True, return_dict=False))
        except Exception as err:  # noqa: BLE001 - mistral-common's validation errors name the rule broken
            raise DataFormatError(f"{where}: mistral-common refuses this conversation: {err}") from None
        if encoded[: len(ids)] != ids:
            raise DataFormatError(
                f"{where}: mistral-common encodes an earlier turn differently once turn {index} comes"
            )
        new = encoded[len(ids) :]
        start = max((i + 1 for i, token in enumerate(new) if token == answer_start), default=0)
        labels += [IGNORE_INDEX] * start + (new[start:] if trains[index] else [IGNORE_INDEX] * (len(new) - start))
        ids = encoded
    return ids, labels
