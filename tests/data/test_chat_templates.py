"""Chat templates by every name Axolotl ships: meshkit's own by name, and the names of templates a model family's
tokenizers carry take the tokenizer's own with a notice — or, where the tokenizer has none, one line saying how to
give it."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.data.chat_templates import (  # noqa: E402
    NAMES,
    SHIPPED_BY_TOKENIZERS,
    TEMPLATES,
    ChatTemplateError,
    chat_template,
    template_note,
)

# Axolotl's ChatTemplate enum (src/axolotl/utils/schemas/enums.py), as facts: every name must mean something here
AXOLOTL_TEMPLATE_NAMES = (
    "alpaca", "chatml", "mistral_v1", "mistral_v2v3", "mistral_v3_tekken", "mistral_v7_tekken", "gemma", "cohere",
    "llama3", "llama3_2_vision", "llama4", "phi_3", "phi_35", "deepseek_v2", "deepseek_v3", "jamba", "jinja",
    "qwen_25", "qwen3", "qwen3_5", "falcon_h1", "nemotron_h", "tokenizer_default", "exaone", "exaone4", "metharme",
    "pixtral", "llava", "qwen2_vl", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "command_a",
    "command_a_tool_use", "command_a_rag", "aya",
)  # fmt: skip


def test_every_axolotl_template_name_is_known() -> None:
    known = set(NAMES) | SHIPPED_BY_TOKENIZERS
    assert [name for name in AXOLOTL_TEMPLATE_NAMES if name not in known] == []
    assert not SHIPPED_BY_TOKENIZERS & set(TEMPLATES)  # a name is carried here or taken from the tokenizer, not both


def test_a_family_name_takes_the_tokenizers_own_template_with_a_notice(tokenizer) -> None:
    with_own = copy.copy(tokenizer)
    with_own.chat_template = TEMPLATES["chatml"]
    assert chat_template("cohere", None, with_own) == TEMPLATES["chatml"]
    assert "cohere's tokenizers ship: the tokenizer's own is used" in str(template_note("cohere"))
    assert template_note("llama3") is None  # carried here: no notice
    without = copy.copy(tokenizer)
    without.chat_template = None
    with pytest.raises(ChatTemplateError, match="this tokenizer has none: give it as chat_template: jinja"):
        chat_template("llama4", None, without)
    with pytest.raises(ChatTemplateError, match="'cohear' is not one meshkit knows"):
        chat_template("cohear", None, with_own)
