"""Axolotl's eot_tokens / train_on_eot: which end-of-turn tokens of a chat count in the loss."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.formats import Formatter  # noqa: E402
from meshkit.data.jsonl import DataFormatError  # noqa: E402
from meshkit.training.loss import IGNORE_INDEX  # noqa: E402

CHAT = {
    "messages": [
        {"role": "user", "content": "Shout river"},
        {"role": "assistant", "content": "RIVER"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "RIVER!"},
    ]
}


def _trained_ends(tokenizer, mode: str | None, eot=("<|im_end|>",)) -> list[bool]:
    entry = DatasetEntry(path=".", type="chat_template", chat_template="chatml", train_on_eot=mode)
    sample = Formatter(tokenizer, False, entry, eot_tokens=eot).chat_template(CHAT, "r:1")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [label != IGNORE_INDEX for token, label in zip(sample.input_ids, sample.labels, strict=True) if token == end]


def test_end_of_turn_tokens_train_as_train_on_eot_says(tokenizer) -> None:
    assert _trained_ends(tokenizer, None) == [False, True, False, True]  # turn: the trained turns' own
    assert _trained_ends(tokenizer, "all") == [True, True, True, True]
    assert _trained_ends(tokenizer, "last") == [False, False, False, True]
    assert _trained_ends(tokenizer, "none") == [False, False, False, False]


def test_an_end_of_turn_token_must_be_one_token(tokenizer) -> None:
    with pytest.raises(DataFormatError, match="eot_tokens: 'not one token' is .* tokens of this tokenizer, not one"):
        _trained_ends(tokenizer, "all", eot=("not one token",))
