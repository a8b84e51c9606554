"""The strategy planner: the rules it follows, that it never proposes what does not fit, and its YAML output."""

from __future__ import annotations

import json

import pytest
import yaml

from meshkit.config.resolve import resolve
from meshkit.planning.estimate import ModelShape, estimate_memory
from meshkit.planning.plan import HEADROOM, Cluster, PlanError, plan
from meshkit.planning.step_recipe import StepRecipe
from tests.helpers.cli import meshkit, meshkit_here

SMALL = ModelShape.transformer(layers=12, hidden=768, heads=12, vocab=50257)  # GPT-2 small
WIDE = ModelShape.transformer(layers=2, hidden=65536, heads=64, vocab=32000)  # one block: 103 GB in bf16


def test_a_model_that_fits_one_gpu_gets_plain_ddp() -> None:
    result = plan(SMALL, Cluster(8, 80.0), seq_len=1024, global_batch=64)
    best = result.fitting[0]
    assert (best.layout.dp, best.layout.tp, best.layout.pp, best.layout.zero_stage) == (8, 1, 1, 0)
    assert "plain DDP" in best.reason


def test_a_layer_too_large_for_one_gpu_forces_tensor_parallel_within_the_node() -> None:
    cluster = Cluster(8, 80.0, nodes=4)
    result = plan(WIDE, cluster, seq_len=2048, global_batch=64)
    assert result.fitting and all(p.layout.tp > 1 for p in result.fitting)
    assert all(p.layout.tp <= cluster.gpus_per_node for p in result.fitting)
    assert "largest layer does not fit one GPU" in result.fitting[0].reason


def test_every_proposed_layout_fits_by_the_estimator() -> None:
    cluster = Cluster(8, 24.0, nodes=4, intra_node="pcie", inter_node="ethernet")
    model = ModelShape.transformer(layers=40, hidden=5120, heads=40, vocab=32000)
    result = plan(model, cluster, seq_len=2048, global_batch=128)
    assert result.fitting
    for layout in (planned.layout for planned in result.fitting):
        estimate = estimate_memory(
            model, seq_len=2048, micro_batch=1, precision="bf16", zero_stage=layout.zero_stage, dp=layout.dp,
            tp=layout.tp, pp=layout.pp, cp=layout.cp, activation_checkpointing=layout.activation_checkpointing,
            offload=layout.offload,
        )  # fmt: skip
        assert estimate.total_gb <= cluster.gpu_mem_gb * HEADROOM
    best = result.fitting[0]
    assert best.layout.pp > 1 and "across the slow inter-node links" in best.reason  # pipeline over ethernet


def test_nothing_fits_names_the_smallest_change() -> None:
    big = ModelShape.transformer(layers=80, hidden=8192, heads=64, vocab=32000)
    result = plan(big, Cluster(2, 16.0), seq_len=2048, global_batch=8)
    assert not result.fitting
    assert "nothing fits in 16 GB per GPU" in result.suggestion and "use GPUs with at least" in result.suggestion
    with pytest.raises(PlanError, match="--intra-node is one of nvlink, nvlink4, pcie"):
        plan(SMALL, Cluster(8, 80.0, intra_node="infiniband"), seq_len=1024, global_batch=64)


@pytest.mark.slow
def test_emit_config_writes_a_layout_meshkit_train_runs(tmp_path) -> None:
    model = tmp_path / "model.yaml"
    model.write_text("model:\n  dim: 32\n  n_layers: 2\n  n_heads: 2\n  max_seq_len: 64\n")
    emitted = tmp_path / "plan.yaml"
    proc = meshkit_here(
        "plan", str(model), "--gpus-per-node", "2", "--gpu-mem-gb", "80", "--seq-len", "32",
        "--global-batch", "4", "--emit-config", str(emitted), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ranked = json.loads(proc.stdout[: proc.stdout.rindex("]") + 1])
    assert ranked[0]["dp"] == 2 and ranked[0]["zero_stage"] == 0
    config = yaml.safe_load(emitted.read_text())
    assert config["launch"]["nproc_per_node"] == 2 and config["model"]["dim"] == 32
    resolve(file=emitted)  # a valid meshkit config
    run = meshkit("train", str(emitted), "train.steps=2", f"logging.dir={tmp_path / 'run'}", timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["grad_accum_steps"] == config["grad_accum_steps"]


def test_a_layout_with_recompute_emits_meshkit_activation_checkpointing() -> None:
    from meshkit.config import RunConfig
    from meshkit.config.layout import Layout
    from meshkit.planning.plan import to_config

    layout = Layout.planned(
        dp=4, tp=2, pp=1, cp=1, zero_stage=3, microbatches=2, activation_checkpointing="full", offload="none"
    )
    config = RunConfig(**to_config(layout, Cluster(8, 24.0), seq_len=2048, global_batch=8, precision="bf16"))
    assert config.activation_checkpointing.mode == "full"
    assert (config.parallel.tp, config.parallel.dp_shard, config.sharding.zero_stage) == (2, 4, 3)


def test_the_slow_link_rule_layout_is_emitted_and_meshkit_accepts_it() -> None:
    """DP + PP + TP + ZeRO-1 (the rule for slow inter-node links and small memory) is a layout meshkit runs."""
    from meshkit.config import RunConfig
    from meshkit.config.layout import Layout
    from meshkit.planning.plan import to_config

    layout = Layout.planned(
        dp=2, tp=2, pp=2, cp=1, zero_stage=1, microbatches=4, activation_checkpointing="none", offload="none"
    )
    config = RunConfig(**to_config(layout, Cluster(4, 24.0, nodes=2), seq_len=2048, global_batch=8, precision="bf16"))
    dims = Layout.from_config(config.parallel, 8)
    assert (dims.pp, dims.tp, dims.dp_replicate * dims.dp_shard, config.sharding.zero_stage) == (2, 2, 2, 1)


def test_eight_bit_adam_lets_the_planner_keep_more_layouts_and_step_faster() -> None:
    model = ModelShape.transformer(layers=32, hidden=4096, heads=32, vocab=32000)  # ~7B
    cluster = Cluster(8, 40.0)
    adam = plan(model, cluster, seq_len=2048, global_batch=64)
    eight = plan(model, cluster, seq_len=2048, global_batch=64, optimizer="adam8bit")
    assert len(eight.fitting) > len(adam.fitting)  # 2 bytes of state per parameter instead of 8
    shared = {layout.describe(): layout for layout in adam.fitting}
    for layout in eight.fitting:
        if layout.describe() in shared:
            on_device = layout.layout.offload == "none"  # offloaded states cost no device memory either way
            assert layout.memory_gb < shared[layout.describe()].memory_gb or not on_device
            assert layout.time.step_s < shared[layout.describe()].time.step_s
    proc = meshkit_here(
        "plan", "--params", "1e9", "--layers", "8", "--hidden", "2048", "--heads", "16", "--optimizer", "lion"
    )
    assert proc.returncode == 2 and "--optimizer 'lion' is not one the planner knows" in proc.stderr


def test_the_planner_counts_a_frozen_reference_copy() -> None:
    """Preference training with a frozen copy: every layout needs the copy's weights more, as laid out; the
    base with adapters off needs nothing more."""
    model = ModelShape.transformer(layers=32, hidden=4096, heads=32, vocab=32000)
    cluster = Cluster(8, 80.0)
    plain = {lay.layout: lay for lay in plan(model, cluster, seq_len=2048, global_batch=64).fitting}
    with_copy = plan(model, cluster, seq_len=2048, global_batch=64, reference="copy")
    assert with_copy.fitting and len(with_copy.fitting) < len(plain)  # some layouts no longer fit
    for planned in with_copy.fitting:
        assert planned.estimate is not None and planned.estimate.gb("reference") > 0
        more = planned.estimate.gb("reference") * (1 + StepRecipe().allocator_allowance)
        assert planned.memory_gb == pytest.approx(plain[planned.layout].memory_gb + more)
    adapters = plan(model, cluster, seq_len=2048, global_batch=64, reference="adapters")
    assert {lay.layout for lay in adapters.fitting} == set(plain)
    # the step: a copy or the base with adapters off runs a forward over the rows (a third of the training pass,
    # bubble included); scores computed once before training cost no step time
    precomputed = {
        lay.layout: lay for lay in plan(model, cluster, seq_len=2048, global_batch=64, reference="precomputed").fitting
    }
    for planned in adapters.fitting:
        time, before = planned.time, plain[planned.layout].time
        assert time is not None and before is not None
        assert time.reference_s == pytest.approx((before.compute_s + before.bubble_s) / 3)
        assert time.step_s == pytest.approx(before.step_s + time.reference_s)
        assert precomputed[planned.layout].step_s == pytest.approx(before.step_s)
