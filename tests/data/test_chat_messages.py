"""Axolotl's chat_template dataset keys beyond role and content: reasoning (`field_thinking`,
`template_thinking_key`, `split_thinking`), a record's system text and tools, every mapped turn property, per-turn
training (`message_field_training`) and trained character spans (`message_field_training_detail`), and an entry's
shards (`shards`, `shards_idx`)."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.formats import Formatter  # noqa: E402
from meshkit.data.jsonl import DataFormatError  # noqa: E402
from meshkit.data.sources import load_source  # noqa: E402
from meshkit.training.loss import IGNORE_INDEX  # noqa: E402

# A template that writes what these keys feed it: tools, a turn's name, its reasoning under `reasoning_content` or
# `analysis`, and the turns in chatml. (Newlines as expressions: transformers trims the one after a block tag.)
TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}{{ '\\n' }}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.analysis %}<analysis>{{ m.analysis }}</analysis>{% endif %}"
    "{{ m.content }}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


@pytest.fixture
def chat_tokenizer(tokenizer):
    own = copy.copy(tokenizer)
    own.chat_template = TEMPLATE
    return own


def _text(tokenizer, **entry_keys) -> callable:
    formatter = Formatter(tokenizer, False, DatasetEntry(path="x", type="chat_template", **entry_keys))

    def render(record: dict) -> tuple[str, str]:
        sample = formatter.convert(record, "data.jsonl:1", "chat_template")
        trained = [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
        return tokenizer.decode(sample.input_ids), tokenizer.decode(trained)

    return render


def _turns(*turns: dict) -> dict:
    return {"messages": list(turns)}


USER = {"role": "user", "content": "What is two and two?"}


def test_reasoning_reaches_the_template_by_axolotls_keys(chat_tokenizer) -> None:
    answer = {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two make four."}
    text, trained = _text(chat_tokenizer)(_turns(USER, answer))  # (the default: reasoning_content)
    assert "<think>Two and two make four.</think>Four." in text and "<think>Two and two" in trained
    own_keys = {"role": "assistant", "content": "Four.", "thinking": "Add them."}  # (gpt-oss's examples' form)
    text, _ = _text(chat_tokenizer, field_thinking="thinking", template_thinking_key="analysis")(_turns(USER, own_keys))
    assert "<analysis>Add them.</analysis>Four." in text
    inline = {"role": "assistant", "content": "<think> Add them. </think>\n Four."}
    text, _ = _text(chat_tokenizer, split_thinking=True)(_turns(USER, inline))
    assert "<think>Add them.</think>Four.<|im_end|>" in text
    text, _ = _text(chat_tokenizer)(_turns(USER, inline))  # (without split_thinking the content stays as written)
    assert "<think> Add them. </think>\n Four." in text


def test_a_records_system_text_tools_and_mapped_properties_reach_the_template(chat_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": json.dumps({"type": "object"})}}]
    turns = [{"role": "user", "content": "Add.", "who": "ann"}, {"role": "assistant", "content": "4"}]
    record = {"system": "Be brief.", "tools": json.dumps(tools), "messages": turns}
    mapped = {"role": "role", "content": "content", "name": "who"}
    text, _ = _text(chat_tokenizer, message_property_mappings=mapped)(record)
    assert text.startswith('<tools>[{"type": "function"')
    assert '"parameters": {"type": "object"}' in text  # (JSON text parsed, as Axolotl does)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "<|im_start|>user (ann)\nAdd." in text
    text, _ = _text(chat_tokenizer, field_system="persona", drop_system_message=True)({**record, "persona": "X"})
    assert "system" not in text


def test_a_turns_own_training_flag_and_trained_spans(chat_tokenizer) -> None:
    flagged = _turns({**USER, "train": True}, {"role": "assistant", "content": "Four.", "train": False})
    _, trained = _text(chat_tokenizer, message_field_training="train")(flagged)
    assert "What is two and two?" in trained and "Four" not in trained
    content = "Four. Also five."
    spans = [{"begin_offset": 0, "end_offset": 4, "train": True},
             {"begin_offset": 5, "end_offset": len(content) - 1, "train": False}]  # fmt: skip
    detailed = _turns(USER, {"role": "assistant", "content": content, "spans": spans})
    _, trained = _text(chat_tokenizer, message_field_training_detail="spans")(detailed)
    assert "Four." in trained and "five" not in trained and "<|im_end|>" in trained  # (the turn's end trains)
    with pytest.raises(DataFormatError, match=r"data.jsonl:1: messages\[1\]: 'train' .* must be true or false"):
        _text(chat_tokenizer, message_field_training="train")(_turns(USER, {"role": "assistant", "content": "x",
                                                                            "train": "yes"}))  # fmt: skip


def test_an_entrys_shards_split_its_records_by_the_run_seed(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(40)))

    def shard(index: int, seed: int = 0) -> list[str]:
        entry = DatasetEntry(path=str(path), type="completion", shards=4, shards_idx=index)
        return [row["text"] for row in load_source(entry, seed=seed).dataset]

    parts = [shard(i) for i in range(4)]
    assert [len(p) for p in parts] == [10] * 4
    assert sorted(sum(parts, [])) == sorted(f"r{i}" for i in range(40))  # disjoint, covering
    assert parts[1] == shard(1) and parts[1] != shard(1, seed=1) and parts[0] != [f"r{i}" for i in range(10)]
    with pytest.raises(ValueError, match="shards_idx 4 of 4 shards: it counts from 0"):
        DatasetEntry(path=str(path), type="completion", shards=4, shards_idx=4)


def test_a_records_place_is_worked_out_only_for_an_error(tmp_path, chat_tokenizer, monkeypatch) -> None:
    """Naming a json-lines record's line reads its file: done for every record, a dataset's tokenizing grew with
    the square of its length (100 s for 5k conversations)."""
    from meshkit.data import sources
    from meshkit.data.tokenized import load_samples

    looked_up: list[int] = []
    where = sources.RecordSource.where

    def counted(self, index: int) -> str:
        looked_up.append(index)
        return where(self, index)

    monkeypatch.setattr(sources.RecordSource, "where", counted)
    path = tmp_path / "chat.jsonl"
    turns = [USER, {"role": "assistant", "content": "Four."}]
    path.write_text("".join(json.dumps(_turns(*turns)) + "\n" for _ in range(30)) + json.dumps(_turns(USER, 7)) + "\n")
    entry = DatasetEntry(path=str(path), type="chat_template")
    with pytest.raises(DataFormatError, match=r"chat.jsonl:31: messages\[1\] must be an object"):
        load_samples([entry], chat_tokenizer, sequence_len=256, train_on_inputs=False, keep_in_memory=True)
    assert looked_up == [30]  # the broken record only
