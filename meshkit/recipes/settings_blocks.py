"""Nested blocks of the fine-tune's keys (Axolotl's `peft:` block and `lr_groups` entries)."""

from __future__ import annotations

from pydantic import Field

from meshkit.config.section import Section


class LoftQBits(Section):
    loftq_bits: int = Field(4, description="bits of LoftQ's quantization of the base (peft's LoftQConfig)")


class PeftBlock(Section):
    loftq_config: LoftQBits | None = Field(
        None, description="LoftQ: the base quantized, the adapters start from the error"
    )


class LrGroup(Section):
    name: str = Field(description="the group's name")
    modules: tuple[str, ...] = Field(description="parameter-name parts: matrices whose names hold one join the group")
    lr: float = Field(gt=0, description="the group's learning rate")
