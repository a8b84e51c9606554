"""LoRA layers under tensor parallel, with and without sequence parallel, train like one process — with the
adapters away from their start (B ≠ 0), so that A's gradient counts from the first step: a column-split layer's
A was summed over tp although B's column split had already summed its input gradient (twice the gradient)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.lora_runs import lora_reference, train_adapted  # noqa: E402
from tests.helpers.training import assert_close_relative, assert_state_close  # noqa: E402

LAYOUTS = {"tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}, "fsdp2_tp2_sp": {
    "tp": 2, "sequence_parallel": True, "zero_stage": 3}}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=[pytest.mark.slow, pytest.mark.sweep])])
def test_lora_under_tensor_and_sequence_parallel_trains_like_one_process(family: str) -> None:
    results = run_world(train_adapted, 4, family, LAYOUTS, timeout=300)
    losses, state = lora_reference(family)
    for by_layout in results:
        for got in by_layout.values():
            assert_close_relative(got["losses"], losses, 1e-5)
            assert_state_close(got["state"], state, 1e-5)
