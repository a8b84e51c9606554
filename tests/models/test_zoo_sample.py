"""The suite's fixed sample of the zoo sweep (`bench/zoo.py`): causal-LM types of transformers that meshkit's
matrix never names, each in the layouts where a fact about it was once missed, run exactly as the sweep runs them
(a tiny random model, a world of 2 gloo ranks, 4 steps against one process). The whole sweep is a bench."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from bench.zoo import run_type  # noqa: E402

# type -> {layout: what the cell must be}, with the fact each one shows
SAMPLE = {
    "trocr": {"ddp2": "ok", "tp2": "refused"},  # its own loss takes labels already shifted; reshapes to full width
    "bert-generation": {"ddp2": "ok"},  # a causal LM by transformers' registry, not by its class name
    "gpt_oss": {"tp2": "ok"},  # per-head attention sinks split with the heads (and an MoE)
    "doge": {"tp2": "ok"},  # a declared row split that feeds a mask, not the output: its attention kept whole
    "olmo": {"pp2": "ok"},  # a final norm without weights runs on the last stage
    "opt": {"pp2": "ok"},  # embeddings projected in: later stages' stand-ins as wide as the hidden states
    "openai-gpt": {"pp2": "ok", "tp2_sp": "ok"},  # blocks that return lists; the whole sequence reshaped at the end
    "qwen3_next": {"tp2": "ok", "tp2_sp": "ok"},  # a linear attention declared as gathered layers: whole inside
    "lfm3": {"ep2": "ok"},  # a convolution's 3-D kernel is no expert bank
    "deepseek_v32": {"cp2": "refused"},  # a sparse-attention indexer reads the mask ring attention does not build
    "hrm_text": {"cp2": "refused"},  # a second stack of blocks calls the attention functions
    "gpt_neox": {"tp2_sp": "ok"},  # fused query_key_value cut per head
    "gpt_neox_japanese": {"tp2": "ok"},  # a bias added after the attention: its gradient whole, not summed
    "granitemoehybrid": {"ddp2": "ok"},  # use_cache=False through the forward's **kwargs
    "inkling2_text": {"pp2": "refused"},  # a second stream carried from block to block
    "inkling_text": {"cp2": "refused"},  # a relative position bias handed to the attention function
    "longcat_flash": {"ddp2": "ok"},  # zero-computation experts: a bank no token of one rank reaches
    "minimax_m3_vl_text": {"tp2_sp": "ok"},  # declared gathered columns and a row split of the whole: one scatter
    "modernbert-decoder": {"pp2": "ok"},  # embeddings called by keyword on a later stage
    "nanochat": {"pp2": "ok"},  # a weightless norm before and after the blocks: a stage hands on the next block's input
    "phi4_multimodal": {"pp2": "ok"},  # a feature embedding its declared pipeline plan leaves out: first stage
    "diffllama": {"tp2": "ok"},  # heads paired half with half: the attention kept whole
    "gemma3n_text": {"tp2": "ok"},  # a declared MLP split whose activation sparsity mixes features: kept whole
    "ergo": {"tp2": "ok", "ep2": "ok"},  # q, k, v heads in one layer cut by head counts; a per-expert norm
    "minicpm5_moe": {"tp2_sp": "ok"},  # k/v declared unit_colwise: split by heads like colwise
    "deepseek_v4": {"tp2_sp": "refused", "cp2": "refused"},  # tensor parallel splits none of its layers (it ran
    # unsplit on every rank, equal to one process); keys beyond the sequence (a compressed memory)
}


@pytest.mark.world
@pytest.mark.parametrize("model_type", sorted(SAMPLE))
def test_a_sampled_causal_lm_type_trains_as_one_process_or_is_refused_in_one_line(model_type: str) -> None:
    wanted = SAMPLE[model_type]
    cells = run_type(model_type, list(wanted), timeout=240)
    for layout, status in wanted.items():
        cell = cells[layout]
        detail = cell.get("reason") or {key: cell.get(key) for key in ("loss_error", "weight_error", "worst")}
        assert cell["status"] == status, f"{model_type} {layout}: {cell['status']} ({detail})"
        if status == "refused":
            assert "\n" not in cell["reason"] and f"use {layout[:2]}=1" in cell["reason"]
