"""YAML 1.1 reads `off`, `no` and `on` as booleans; a key whose values are words means the word the user wrote — in
a config file, in the environment, in a command-line assignment and in a fine-tune config alike."""

from __future__ import annotations

from typing import Literal, Optional

import pytest

from meshkit.config.resolve import ConfigError, resolve
from meshkit.config.section import word_choices


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("fused_loss: off\n", "fused_loss", "off"),
        ("fused_loss: on\n", "fused_loss", "on"),
        ("precision: no\n", "precision", "no"),
        ("activation_checkpointing:\n  mode: no\n", "activation_checkpointing.mode", "none"),
    ],
)
def test_a_word_yaml_reads_as_a_boolean_is_the_word_in_a_file(tmp_path, text, key, expected) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    value = resolve(file=path).config
    for part in key.split("."):
        value = getattr(value, part)
    assert value == expected


def test_the_environment_and_assignments_read_the_same_words() -> None:
    assert resolve(env={"MESHKIT_FUSED_LOSS": "off"}).config.fused_loss == "off"
    assert resolve(flags={"fused_loss": False}).config.fused_loss == "off"
    assert resolve(flags={"precision": False}).config.precision == "no"


def test_a_boolean_with_no_word_among_the_choices_is_still_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        resolve(flags={"precision": True})  # (precision has no word for true: no, bf16, fp16)
    assert "precision" in str(refused.value) and "\n" not in str(refused.value).strip()


def test_word_choices_look_inside_optional_and_leave_booleans_alone() -> None:
    assert word_choices(Literal["auto", "on", "off"]) == ("auto", "on", "off")
    assert word_choices(Optional[Literal["none", "cpu"]]) == ("none", "cpu")
    assert word_choices(bool) == () and word_choices(bool | Literal["auto"]) == ()


def test_a_finetune_config_and_its_overrides_read_off_as_off(tmp_path, material) -> None:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from meshkit.recipes.finetune_config import resolve_finetune
    from tests.helpers.finetune_runs import write_config

    path = write_config(tmp_path / "ft.yaml", material)
    path.write_text(path.read_text() + "fused_loss: off\n")
    assert resolve_finetune(path, [], env={}).resolved.config.fused_loss == "off"
    assert resolve_finetune(path, ["fused_loss=on"], env={}).resolved.config.fused_loss == "on"
    assert resolve_finetune(path, ["fused_loss=off"], env={}).resolved.config.fused_loss == "off"
