"""Templates that render an earlier turn differently once later turns exist — Qwen3's writes an assistant turn's
reasoning only after the last user message — are read as they render the whole conversation: each message found
in the whole rendering, the trained turns' text (reasoning, content and end-of-turn marks) trained on, and an
earlier turn's dropped reasoning nowhere, as the model will read such a conversation."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.data.chat_templates import TEMPLATES  # noqa: E402
from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.formats import Formatter  # noqa: E402
from meshkit.data.turn_regions import message_regions  # noqa: E402
from meshkit.training.loss import IGNORE_INDEX  # noqa: E402

RECORD = {
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "thinking": "greet back"},
        {"role": "user", "content": "add 2 and 2"},
        {"role": "assistant", "content": "4", "thinking": "two plus two"},
    ]
}


@pytest.fixture
def qwen3_tokenizer(tokenizer):
    chat = copy.copy(tokenizer)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat.chat_template = TEMPLATES["qwen3"]
    return chat


def _trained_text(tokenizer, sample) -> str:
    return tokenizer.decode([token for token in sample.labels if token != IGNORE_INDEX])


def test_the_last_turns_reasoning_is_trained_and_an_earlier_ones_is_not_there(qwen3_tokenizer) -> None:
    entry = DatasetEntry(path="x", type="chat_template", field_thinking="thinking")
    sample = Formatter(qwen3_tokenizer, False, entry).chat_template(copy.deepcopy(RECORD), "record 1")
    text = qwen3_tokenizer.decode(sample.input_ids)
    assert text == qwen3_tokenizer.apply_chat_template(
        [{k: v for k, v in m.items() if k != "thinking"} | ({"reasoning_content": m["thinking"]} if "thinking" in m
         else {}) for m in RECORD["messages"]], tokenize=False)  # fmt: skip
    assert "greet back" not in text  # (Qwen3 drops reasoning before the last question)
    assert _trained_text(qwen3_tokenizer, sample) == "hello<|im_end|>\n<think>\ntwo plus two\n</think>\n\n4<|im_end|>\n"
    ids = list(sample.input_ids)
    assert ids == qwen3_tokenizer(text, add_special_tokens=False).input_ids  # the pieces tokenize as the whole


def test_a_template_that_renders_turn_by_turn_splits_the_same_either_way(qwen3_tokenizer) -> None:
    chatml = copy.copy(qwen3_tokenizer)
    chatml.chat_template = TEMPLATES["chatml"]
    messages = [{"role": m["role"], "content": m["content"]} for m in RECORD["messages"]]
    whole, regions = message_regions(lambda turns: chatml.apply_chat_template(turns, tokenize=False), messages,
                                     ("content",))  # fmt: skip
    assert [whole[start:end] for start, end in regions] == ["hi", "hello", "add 2 and 2", "4"]
    entry = DatasetEntry(path="x", type="chat_template")
    sample = Formatter(chatml, False, entry).chat_template({"messages": messages}, "record 1")
    assert _trained_text(chatml, sample) == "hello<|im_end|>\n4<|im_end|>\n"
