"""The planner answers "does it fit?": layouts restricted to what the user fixed (--strategy, --tp, ...), why a
layout was dropped (the limit and its largest term), the host memory offload needs, the runtime allowance counted,
`--explain`'s terms, and a table that stays within 80 columns."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from meshkit.planning.estimate import ModelShape
from meshkit.planning.plan import Cluster, LayoutFilter, PlanError, over_limit, plan
from tests.helpers.cli import meshkit

# Llama-3-70B's shape (GQA 64/8 heads, SwiGLU 28672), as its config.json gives it
LLAMA_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
SHAPE = ModelShape.transformer(layers=80, hidden=8192, heads=64, vocab=128256, ffn=28672, kv_heads=8)
SIXTEEN = Cluster(8, 80.0, 2)


def test_plain_zero3_without_offload_is_dropped_naming_the_limit_and_its_largest_term() -> None:
    only = LayoutFilter.of("zero3", tp=1, pp=1, offload="none")
    result = plan(SHAPE, SIXTEEN, seq_len=4096, global_batch=32, only=only, runtime_gb=2.0)
    assert not result.fitting and result.budget_gb == pytest.approx(72.0)
    assert "the 72.0 GB per-GPU limit (largest term: optimizer" in result.suggestion
    assert "with zero_stage=3 tp=1 pp=1 offload=none" in result.suggestion
    assert all(dropped.layout.zero_stage == 3 and dropped.layout.tp == 1 for dropped in result.dropped)


def test_filters_keep_what_the_user_fixed_and_offload_counts_host_memory() -> None:
    result = plan(SHAPE, SIXTEEN, seq_len=4096, global_batch=32, only=LayoutFilter.of("zero3"))
    assert result.fitting and all(planned.layout.zero_stage == 3 for planned in result.fitting)
    offloaded = [planned for planned in result.fitting if planned.layout.offload == "cpu"]
    assert offloaded
    for planned in offloaded:  # a node's 8 ranks each keep their optimizer states in its host memory
        assert planned.host_gb_per_node == pytest.approx(8 * planned.estimate.host_gb) and planned.host_gb_per_node > 0
    limited = plan(SHAPE, SIXTEEN, seq_len=4096, global_batch=32, only=LayoutFilter.of("zero3"), host_mem_gb=100)
    assert all(planned.host_gb_per_node <= 100 for planned in limited.fitting)
    reasons = [over_limit(dropped, limited.budget_gb, 100) for dropped in limited.dropped]
    assert any(reason and "GB of host memory per node" in reason for reason in reasons)
    with pytest.raises(PlanError, match="--strategy zero4: choose one of ddp, zero1, zero2, zero3, fsdp"):
        LayoutFilter.of("zero4")
    with pytest.raises(PlanError, match="no layout of 16 GPUs has tp=3"):
        plan(SHAPE, SIXTEEN, seq_len=4096, global_batch=32, only=LayoutFilter.of(tp=3))


def test_the_runtime_allowance_is_counted_on_every_gpu() -> None:
    only = LayoutFilter.of("zero3", tp=1, pp=1, activation_checkpointing="full", offload="cpu")
    bare = plan(SHAPE, SIXTEEN, seq_len=4096, global_batch=32, only=only).fitting[0]
    counted = plan(SHAPE, SIXTEEN, seq_len=4096, global_batch=32, only=only, runtime_gb=2.0).fitting[0]
    assert counted.memory_gb == pytest.approx(bare.memory_gb + 2.0)


@pytest.mark.slow
def test_the_command_explains_and_its_table_fits_80_columns(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    args = ("plan", str(config), "--gpus-per-node", "8", "--nodes", "2", "--gpu-mem-gb", "80", "--seq-len", "4096",
            "--global-batch", "32")  # fmt: skip
    table = meshkit(*args, "--top", "3", env={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    assert max(len(line) for line in table.stdout.splitlines()) <= 80 and "host/node" in table.stdout
    assert "2 GB of it for the runtime (--runtime-gb)" in " ".join(table.stdout.split())
    explained = meshkit(*args, "--strategy", "zero3", "--tp", "1", "--pp", "1", "--offload", "none", "--explain",
                        env={"COLUMNS": "200"})  # fmt: skip
    assert explained.returncode == 2 and "largest term: optimizer" in explained.stderr
    for term in ("params", "grads", "optimizer", "activations", "buffers", "runtime", "total", "limit"):
        assert f"\n  {term}" in explained.stdout, term
    assert "= 80 GB × 90% headroom" in explained.stdout and "does not fit" in explained.stdout


def test_explain_shows_each_layers_split_and_what_decided_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from meshkit.cli.tp_plan_view import tensor_parallel_lines

    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    transformers.AutoConfig.for_model("llama", **shape).save_pretrained(tmp_path / "llama")
    transformers.AutoConfig.for_model("falcon", new_decoder_architecture=True, num_kv_heads=2, **shape).save_pretrained(
        tmp_path / "falcon"
    )
    llama = "\n".join(tensor_parallel_lines(tmp_path / "llama" / "config.json"))
    assert re.search(r"model\.layers\.\*\.self_attn\.q_proj +colwise +declared", llama)
    assert re.search(r"model\.layers\.\*\.mlp\.down_proj +rowwise +declared", llama)
    falcon = "\n".join(tensor_parallel_lines(tmp_path / "falcon" / "config.json"))  # (no declared plan: traced)
    assert re.search(r"transformer\.h\.\*\.self_attention\.query_key_value +colwise +traced", falcon)
    assert re.search(r"lm_head +replicate", falcon)
    (tmp_path / "bare.json").write_text(json.dumps(LLAMA_70B))  # (no model_type: no model to build)
    assert tensor_parallel_lines(tmp_path / "bare.json")[0].startswith("(not shown: transformers builds no causal LM")


LLAMA_8B = ModelShape.transformer(layers=32, hidden=4096, heads=32, vocab=128256, ffn=14336, kv_heads=8)
EIGHT = Cluster(8, 80.0, 1)


def _zero3_dp8(global_batch: int):
    only = LayoutFilter.of("zero3", tp=1, pp=1, offload="none")
    layouts = plan(LLAMA_8B, EIGHT, seq_len=8192, global_batch=global_batch, only=only).fitting
    return next(lay for lay in layouts if lay.layout.dp == 8)


def test_zero3_traffic_counts_every_micro_steps_gathers() -> None:
    one, four = _zero3_dp8(8), _zero3_dp8(32)
    assert (one.layout.microbatches, four.layout.microbatches) == (1, 4)
    # a forward and a backward all-gather per micro-step, one reduce-scatter per window: (2·4 + 1) / (2·1 + 1)
    assert four.comm_gb == pytest.approx(one.comm_gb * 9 / 3)


def test_the_tie_rule_is_stated_where_it_orders_the_table_and_each_reason_is_true_of_its_row() -> None:
    result = plan(LLAMA_8B, EIGHT, seq_len=8192, global_batch=32)
    tied = [lay for lay in result.fitting if lay.tied]
    untied = [lay for lay in result.fitting if not lay.tied]
    assert all(a.step_s <= b.step_s for a, b in zip(untied, untied[1:], strict=False))  # fastest first...
    assert all(lay.step_s <= min(result.fitting, key=lambda x: x.step_s).step_s * 1.05 for lay in tied)
    fits = {lay.layout for lay in result.fitting}
    from dataclasses import replace

    for lay in result.fitting:
        if "recompute to fit the activations" in lay.reason:
            assert replace(lay.layout, activation_checkpointing="none") not in fits, lay.reason
    done = meshkit("plan", "--params", "8e9", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab",
                   "128256", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--global-batch", "32", "--seq-len", "8192",
                   env={"COLUMNS": "80"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    if tied:
        assert "within 5% of the fastest, the simpler layout first" in " ".join(done.stdout.split())
        assert "≈" in done.stdout


def test_explain_keeps_its_formulas_under_their_column_at_80_columns() -> None:
    done = meshkit("plan", "--params", "8e9", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab",
                   "128256", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--global-batch", "32", "--seq-len", "8192",
                   "--explain", env={"COLUMNS": "80"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    start = next(i for i, line in enumerate(lines) if "(dp" in line and "ZeRO" in line and line[0] != " ")
    terms = lines[start + 1 : next(i for i in range(start + 1, len(lines)) if "limit" in lines[i]) + 1]
    assert terms and all(line.startswith("  ") and len(line) <= 80 for line in terms), terms
