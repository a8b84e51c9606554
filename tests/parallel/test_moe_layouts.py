"""Mixture-of-experts transformers models (Mixtral, Qwen3-MoE, DeepSeek-V3 with shared experts and a dense first
block) in the layouts that exist today, against one plain-torch process on the same global batch: losses and
weights within 1e-5 over 4 steps, the router's auxiliary loss off (the models' default). Tensor parallel splits
attention and dense MLPs as for any model and keeps each expert bank whole on every tp rank; DeepSeek's latent
attention splits its per-head projections and sums the gradient of the rotary key all heads share. Families with
no adapter entry (OLMoE, DeepSeek-V2, PhiMoE, HunYuan, ERNIE 4.5, GraniteMoE, Qwen3-Next) in the layouts that
touch what sets each apart; Qwen3-Next's linear-attention layers refuse cp in one line."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_world
from tests.helpers.hf_layouts import LAYOUTS, run_families
from tests.helpers.moe_matrix import LAYOUT_CELLS as CELLS
from tests.helpers.moe_matrix import MORE_FAMILY_CELLS, assert_like_one_process


@pytest.mark.parametrize("family", sorted(CELLS))
def test_moe_models_train_like_one_process(family: str) -> None:
    results = run_world(run_families, 4, {family: CELLS[family]}, timeout=400)
    for layout in CELLS[family]:
        assert_like_one_process(family, layout, results)
    assert set(CELLS[family]) <= set(LAYOUTS)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("group", sorted(MORE_FAMILY_CELLS))
def test_families_without_an_adapter_entry_train_like_one_process(group: str) -> None:
    cells = MORE_FAMILY_CELLS[group]
    results = run_world(run_families, 4, cells, timeout=400)
    for family, layouts in cells.items():
        for layout in layouts:
            assert_like_one_process(family, layout, results)
