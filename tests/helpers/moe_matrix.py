"""The mixture-of-experts cells the layout tests run, and the support matrix of docs/any-model.md made from them."""

from __future__ import annotations

# family -> layouts (of hf_layouts.LAYOUTS) trained equal to one process, the router's balancing loss off
LAYOUT_CELLS = {  # tests/parallel/test_moe_layouts.py
    "mixtral": ["ddp4", "zero3_4", "tp2", "tp2_sp", "pp2_1f1b", "pp2_tp2_sp"],
    "qwen3_moe": ["zero1_4", "zero3_4", "fsdp2_tp2", "cp2"],
    "deepseek_v3": ["ddp4", "zero3_4", "tp2", "tp2_sp", "pp2_1f1b"],
    "qwen2_moe": ["zero3_4", "tp2", "tp2_sp", "fsdp2_tp2"],  # a shared expert with its own gate, split by tp
}
EXPERT_CELLS = {  # tests/parallel/test_expert_parallel.py
    "mixtral": [
        "ep4",
        "ep2_dp2",
        "ep2_zero3",
        "ep4_zero3",
        "ep2_tp2",
        "ep2_pp2",
        "ep2_clipped",
        "ep2_zero3_recompute",
        "ep2_zero1",
        "ep2_zero2",
        "ep2_zero2_clipped",
        "ep2_tp2_zero1_clipped",
        "ep2_pp2_zero2",
    ],
    "qwen3_moe": ["ep4", "ep2_dp2", "ep2_zero3", "ep2_tp2", "ep2_pp2", "ep2_zero2"],
    "deepseek_v3": ["ep4", "ep2_dp2", "ep2_zero3", "ep4_zero3", "ep2_tp2", "ep2_pp2", "ep2_zero2"],
    "qwen2_moe": ["ep4", "ep2_zero3", "ep2_tp2", "ep2_pp2", "ep2_zero2"],
    # a bank with biases, stored [E, in, out]; under cp, ring attention with its sliding window and sinks
    "gpt_oss": ["ddp4", "cp2", "ep4", "ep2_dp2", "ep2_zero3", "ep2_zero2"],
    "deepseek_v3_q_lora": ["tp2", "ep2_tp2"],  # its query through a low-rank projection too (as released)
}
# families with no adapter entry, in two worlds: what sets each apart (see moe_models.MORE_MOE_FAMILIES)
MORE_FAMILY_CELLS = {  # tests/parallel/test_moe_layouts.py
    "olmoe-deepseek_v2-phimoe": {
        "olmoe": ["tp2", "cp2", "ep2_zero2"],
        "deepseek_v2": ["cp2", "tp2_cp2", "ep2_tp2"],
        "phimoe": ["tp2_sp", "ep2_tp2"],
    },
    "hunyuan-ernie-granite-qwen3_next": {
        "hunyuan_moe": ["tp2", "ep2_dp2"],
        "ernie4_5_moe": ["zero1_4", "ep2_zero2"],
        "granitemoe": ["tp2", "ep2_dp2"],
        "granitemoeshared": ["tp2", "tp2_sp", "ep2_tp2"],
        "qwen3_next": ["cp2", "ep2_dp2", "pp2_1f1b"],
    },
    "llama4": {"llama4": ["tp2", "cp2", "pp2_1f1b", "pp2_tp2", "ep4", "ep2_zero2", "ep2_tp2", "ep2_pp2"]},
}
# the router's balancing loss over the global batch (the "<family>_aux" models), equal to one process
GLOBAL_AUX = ["ddp4_global_aux", "zero3_4_global_aux", "ep4_global_aux", "ep2_dp2_global_aux", "ep2_zero3_global_aux",
              "ep2_tp2_global_aux", "ep2_cp2_global_aux", "pp2_global_aux", "ep2_pp2_global_aux"]  # fmt: skip
# more layouts with the global balancing loss, on one family: pipelines (another schedule, recomputation, cp
# beside pp) and sequence parallel (its routers see parts of the sequences), in a pipeline too
GLOBAL_AUX_MORE = {"mixtral_aux": ["pp2_gpipe_global_aux", "pp2_recompute_global_aux", "pp2_cp2_global_aux",
                                   "tp2_sp_global_aux", "pp2_tp2_sp_global_aux", "ep2_zero2_global_aux"]}  # fmt: skip
# two stages per rank: the counting pass and the terms follow each stage's micro-batches (4 blocks)
INTERLEAVED_AUX = {"mixtral_aux_deep": ["pp2_interleaved_global_aux", "pp2_interleaved_zb_global_aux"]}
GLOBAL_AUX_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
NO_AUXILIARY_LOSS = ("deepseek_v3",)  # it balances its experts by a router bias
REFUSED: dict[tuple[str, str], str] = {  # (family, layout) -> the words of meshkit's one-line refusal
    ("qwen3_next", "cp2"): "mixes tokens without attention in 1 of its blocks, e.g. model.layers.0 (linear_attention)",
}
COLUMNS = {
    "ddp4": "DDP",
    "zero1_4": "ZeRO-1",
    "zero3_4": "ZeRO-3",
    "tp2": "tp 2",
    "tp2_sp": "tp 2 + SP",
    "cp2": "cp 2",
    "pp2_1f1b": "pp 2",
    "ep4": "ep 4",
    "ep2_dp2": "ep 2 × dp 2",
    "ep2_zero3": "ep 2 + ZeRO-3",
    "ep2_zero2": "ep 2 + ZeRO-2",
    "ep2_tp2": "ep 2 × tp 2",
    "ep2_pp2": "ep 2 × pp 2",
    "global_aux": "global aux loss",
}


def assert_like_one_process(family: str, layout: str, results: list[dict]) -> None:
    """Every rank's cell equals one plain-torch process (or is the one-line refusal the table expects)."""
    from tests.helpers.hf_layouts import reference_of
    from tests.helpers.training import assert_close_relative, assert_state_close

    losses, state = reference_of(family, layout)
    for rank, by_cell in enumerate(results):
        got = by_cell[family, layout]
        if (family, layout) in REFUSED:
            assert REFUSED[family, layout] in got.get("refused", "") and "\n" not in got["refused"], got
            continue
        assert "refused" not in got, f"{family} {layout} refused on rank {rank}: {got['refused']}"
        assert_close_relative(got["losses"], losses, 1e-5)
        assert_state_close(got["state"], state, 1e-5)


def render_moe_matrix() -> str:
    """What the MoE tests check, family by family (✓: equal to one process; refused: one line; n/a¹: the model
    has no auxiliary loss)."""
    lines = ["| family | " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    more = {family: cells for group in MORE_FAMILY_CELLS.values() for family, cells in group.items()}
    for family in {**LAYOUT_CELLS, **EXPERT_CELLS, **more}:
        run = {*LAYOUT_CELLS.get(family, ()), *EXPERT_CELLS.get(family, ()), *more.get(family, ())}
        if family in GLOBAL_AUX_FAMILIES:
            run.add("global_aux")
        cells = ["refused" if (family, c) in REFUSED else "✓" if c in run else "not run" for c in COLUMNS]
        cells[-1] = "n/a¹" if family in NO_AUXILIARY_LOSS else cells[-1]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
