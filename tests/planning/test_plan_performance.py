"""The planner's step-time model: predicted MFU against published large runs, the parts of a step it adds up,
and `meshkit plan`'s step time, tokens/s and MFU (table and --json), presets and measured profiles."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from meshkit.config.layout import Layout
from meshkit.planning.estimate import ModelShape
from meshkit.planning.hardware import PRESETS, Hardware, load_profile, save_profile
from meshkit.planning.perf_model import Topology, predict
from meshkit.planning.published_runs import PUBLISHED, compare
from tests.helpers.cli import meshkit_here as meshkit

GPT_1B = ModelShape.transformer(layers=24, hidden=2048, heads=16, vocab=50304)


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda run: run.name)
def test_predicted_mfu_is_within_30_percent_of_the_published_run(run) -> None:
    found = compare(run)
    assert found.layout is not None, f"{run.name}: the published layout does not fit by the estimator"
    assert abs(found.relative_error) <= 0.30, (
        f"{run.name}: predicted MFU {found.predicted_mfu:.3f}, published {run.published_mfu:.3f}"
    )


def _step(**layout) -> object:
    shape = Layout.planned(**{"dp": 8, "tp": 1, "pp": 1, "cp": 1, "zero_stage": 0, "microbatches": 8, **layout})
    return predict(GPT_1B, shape, Topology(8, 1), PRESETS["h100"], seq_len=2048, global_batch=64)


def test_the_step_adds_up_and_each_part_moves_the_way_it_should() -> None:
    ddp = _step()
    parts = ddp.compute_s + ddp.recompute_s + ddp.bubble_s + ddp.optimizer_s + ddp.offload_s + sum(ddp.comm_s.values())
    assert ddp.overhead_s == 0.0 and ddp.step_s == pytest.approx(parts)
    assert ddp.tokens_per_s == pytest.approx(64 * 2048 / ddp.step_s) and 0 < ddp.mfu < 1
    assert (
        _step(activation_checkpointing="full").recompute_s > _step(activation_checkpointing="selective").recompute_s > 0
    )
    few, interleaved = _step(dp=2, pp=4, microbatches=8), _step(dp=2, pp=4, microbatches=8, stages_per_rank=2)
    assert few.bubble_s == pytest.approx(2 * interleaved.bubble_s) and interleaved.comm_s["pp"] > few.comm_s["pp"]
    zero3 = _step(zero_stage=3)
    assert "zero3_gather" in zero3.comm_s and zero3.optimizer_s < ddp.optimizer_s  # optimizer work sharded 8 ways
    across = predict(
        GPT_1B, Layout.planned(16, 1, 1, 1, 1, 4), Topology(8, 2), PRESETS["h100"], seq_len=2048, global_batch=64
    )
    within = predict(
        GPT_1B, Layout.planned(16, 1, 1, 1, 1, 4), Topology(16, 1), PRESETS["h100"], seq_len=2048, global_batch=64
    )
    assert across.comm_link["dp_grads"] == "inter" and across.comm_s["dp_grads"] > within.comm_s["dp_grads"]
    tp = _step(dp=4, tp=2, microbatches=16)
    assert tp.comm_link["tp"] == "intra" and tp.comm_s["tp"] > 0


def test_measured_tensor_parallel_overhead_and_shared_cores_enter_the_step(tmp_path) -> None:
    cpu = Hardware("measured: cpu", 0.05, 6.0, 0.01, 1.0, 1.0, matmul_efficiency=0.9, ranks_per_device=2.0)
    measured = Hardware(**{**cpu.as_json(), "tp_overhead_s": {2: 0.01}})
    profile = tmp_path / "cpu.json"
    save_profile(measured, profile)
    assert load_profile(profile).tp_overhead_s == {2: 0.01}  # JSON's string keys read back as degrees

    def step(hardware: Hardware, **layout: int) -> object:
        shape = Layout.planned(**{"dp": 4, "tp": 1, "pp": 1, "cp": 1, "zero_stage": 0, "microbatches": 1, **layout})
        return predict(GPT_1B, shape, Topology(4, 1), hardware, seq_len=128, global_batch=16, precision="fp32")

    plain, split = step(cpu, dp=2, tp=2, microbatches=2), step(measured, dp=2, tp=2, microbatches=2)
    assert split.overhead_s == pytest.approx(0.01 * 24 * 2) and split.step_s == pytest.approx(plain.step_s + 0.48)
    # 4 pipeline stages on ranks sharing 2 devices' worth of cores lose one device's ramp, not three
    pipeline, alone = (
        step(cpu, dp=1, pp=4, microbatches=4),
        step(replace(cpu, ranks_per_device=1.0), dp=1, pp=4, microbatches=4),
    )
    assert pipeline.bubble_s == pytest.approx(pipeline.compute_s / 4) and alone.bubble_s == pytest.approx(
        3 * alone.compute_s / 4
    )
    assert step(cpu, dp=2, pp=2, microbatches=2).bubble_s == 0.0


@pytest.mark.slow
def test_plan_json_carries_step_time_tokens_per_second_and_mfu(tmp_path) -> None:
    args = ("plan", "--params", "1.3e9", "--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "50304")
    a100 = meshkit(*args, "--json", "--top", "3")
    h100 = meshkit(*args, "--json", "--top", "3", "--gpu", "h100")
    assert a100.returncode == 0 and h100.returncode == 0, a100.stderr + h100.stderr
    first_a100 = json.loads(a100.stdout[: a100.stdout.rindex("]") + 1])[0]
    first_h100 = json.loads(h100.stdout[: h100.stdout.rindex("]") + 1])[0]
    for key in ("step_s", "tokens_per_s", "mfu"):
        assert first_a100[key] > 0
    assert set(first_a100["breakdown"]) >= {"compute_s", "bubble_s", "comm_s", "comm_link", "optimizer_s"}
    assert first_h100["step_s"] < first_a100["step_s"]  # a faster device
    table = meshkit(*args, "--top", "2", env={"COLUMNS": "200"})
    assert table.returncode == 0 and "tokens/s" in table.stdout and "MFU" in table.stdout

    profile = tmp_path / "profile.json"
    save_profile(Hardware("measured: test", 50.0, 24.0, 0.5, 10.0, 10.0, matmul_efficiency=1.0), profile)
    assert load_profile(profile).peak_tflops == 50.0
    measured = meshkit(*args, "--json", "--top", "1", "--profile", str(profile))
    assert measured.returncode == 0, measured.stderr
    assert json.loads(measured.stdout[: measured.stdout.rindex("]") + 1])[0]["step_s"] > first_a100["step_s"]
    both = meshkit(*args, "--gpu", "h100", "--profile", str(profile))
    assert both.returncode == 2 and "--gpu and --profile both name the device" in both.stderr
    unknown = meshkit(*args, "--gpu", "tpu9")
    assert unknown.returncode == 2 and "--gpu tpu9: unknown device; choose one of a100" in unknown.stderr
    profile.write_text('{"name": "x"}')
    broken = meshkit(*args, "--profile", str(profile))
    assert broken.returncode == 2 and "missing peak_tflops" in broken.stderr
