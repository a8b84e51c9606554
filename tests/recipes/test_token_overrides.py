"""`added_tokens_overrides`: a tokenizer's reserved added tokens renamed, their ids kept (so the rows they own in
the embedding are the ones trained); an id that is not an added token is one line."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.recipes.finetune_settings import FinetuneSettings  # noqa: E402
from meshkit.recipes.hf_base import load_tokenizer  # noqa: E402
from meshkit.recipes.token_overrides import TokenOverrideError  # noqa: E402


@pytest.fixture
def reserved_base(tmp_path, tokenizer):
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|reserved_0|>", "<|reserved_1|>"]})
    tokenizer.save_pretrained(tmp_path)
    return tmp_path, tokenizer.convert_tokens_to_ids("<|reserved_0|>"), len(tokenizer)


def _settings(base, overrides) -> FinetuneSettings:
    return FinetuneSettings(base_model=base, datasets=[{"path": "x", "type": "alpaca"}],
                            added_tokens_overrides=overrides)  # fmt: skip


def test_reserved_tokens_are_renamed_in_place(tmp_path, reserved_base) -> None:
    base, reserved, size = reserved_base
    tokenizer = load_tokenizer(_settings(base, {reserved: "<think>", reserved + 1: "</think>"}))
    assert len(tokenizer) == size  # no token added
    assert tokenizer.convert_ids_to_tokens([reserved, reserved + 1]) == ["<think>", "</think>"]
    assert tokenizer("<think>hi</think>", add_special_tokens=False).input_ids[0] == reserved
    assert tokenizer.convert_tokens_to_ids("<|reserved_0|>") != reserved  # the old name is gone
    tokenizer.save_pretrained(tmp_path / "export")  # an export keeps the new names
    again = load_tokenizer(_settings(tmp_path / "export", None))
    assert again.convert_ids_to_tokens(reserved) == "<think>"


def test_an_id_that_is_not_an_added_token_is_one_line(reserved_base) -> None:
    base, reserved, _ = reserved_base
    with pytest.raises(TokenOverrideError, match=r"token id\(s\) \[7\] are not added tokens of this tokenizer"):
        load_tokenizer(_settings(base, {7: "<think>"}))
