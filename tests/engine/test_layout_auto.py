"""`layout: auto`: the planner's top layouts are tried on the real ranks and training continues in the fastest,
in the same processes; each candidate's config is one meshkit runs; a failing candidate is dropped with why."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, TensorDataset

from meshkit import Engine
from meshkit.config import RunConfig
from meshkit.config.layout import Layout
from meshkit.config.resolve import nest, resolve
from meshkit.core.errors import MeshkitError
from meshkit.models.gpt import GPT, GPTConfig
from meshkit.planning.layout_probe import (
    Candidate,
    LayoutProbeError,
    choose,
    diverse,
    layout_values,
    measure,
    with_values,
)
from tests.helpers.cli import meshkit
from tests.helpers.distributed import run_world

MODEL = {"dim": 64, "n_layers": 4, "n_heads": 4, "max_seq_len": 64}


@pytest.mark.slow
@pytest.mark.sweep  # (the suite probes at world 2: test_plan_probe_times_the_layouts_without_training)
def test_layout_auto_probes_at_world_4_and_trains_in_the_fastest(tmp_path) -> None:
    config = tmp_path / "auto.yaml"
    train = {"steps": 2, "micro_batch_size": 2, "seq_len": 64, "log_every": 2}
    probe = {"top_k": 3, "steps": 2}
    config.write_text(yaml.safe_dump({"model": MODEL, "train": train, "probe": probe, "launch": {"nproc_per_node": 4}}))
    auto = meshkit("train", str(config), "layout=auto", f"logging.dir={tmp_path / 'auto'}", timeout=400)
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "candidates probed on these ranks" in auto.stdout
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    probed = summary["layout_probe"]["candidates"]
    ran = [c for c in probed if c["error"] is None]
    assert len(ran) >= 2 and len({c["description"].split(" ZeRO")[0] for c in probed}) >= 2  # different shapes
    assert all(c["predicted"]["step_s"] == c["predicted_step_s"] for c in probed)  # the model's breakdown
    fastest = min(ran, key=lambda c: c["step_s"])
    chosen = fastest["values"]
    layout = summary["layout"]
    assert (layout["tp"], layout["pp"]) == (chosen["parallel.tp"], chosen["parallel.pp"])
    assert summary["zero_stage"] == chosen["sharding.zero_stage"] or chosen["parallel.dp_replicate"] == 1
    # training continued in that layout exactly as a run configured with it by hand
    by_hand = [f"{key}={'null' if value is None else value}" for key, value in chosen.items()]
    manual = meshkit("train", str(config), *by_hand, f"logging.dir={tmp_path / 'manual'}", timeout=300)
    assert manual.returncode == 0, manual.stderr[-3000:]
    hand = json.loads((tmp_path / "manual" / "summary.json").read_text())
    assert hand["params_sha256"] == summary["params_sha256"] and hand["layout"] == layout


def _layout(**fields) -> Layout:
    base = {"dp": 4, "tp": 1, "pp": 1, "cp": 1, "zero_stage": 0, "microbatches": 4}
    return Layout.planned(**{**base, **fields})


def test_each_candidate_is_a_config_meshkit_takes_with_the_same_global_batch() -> None:
    resolved = resolve(code={"model": MODEL, "train": {"micro_batch_size": 2, "seq_len": 64}, "layout": "auto"})
    for layout, dp in (
        (_layout(), 4),
        (_layout(dp=2, pp=2, stages_per_rank=2), 2),
        (_layout(dp=2, tp=2, zero_stage=3), 2),
    ):
        values = layout_values(layout, global_batch=16, micro_batch=2, seq_len=64)
        config = with_values(resolved, values).config
        assert isinstance(config, RunConfig)
        per_rank = config.train.micro_batch_size * config.grad_accum_steps
        assert per_rank * dp == 16  # the global batch the config gave
        if layout.pp > 1:
            assert config.pipeline.schedule == "interleaved_1f1b" and config.pipeline.microbatches == 4
        assert with_values(resolved, values).sources["parallel.tp"] == "layout: auto (probed)"
    shapes = diverse([_layout(zero_stage=1), _layout(zero_stage=2), _layout(dp=2, pp=2), _layout(dp=2, tp=2)], 3)
    assert [(lay.dp, lay.tp, lay.pp, lay.zero_stage) for lay in shapes] == [(4, 1, 1, 1), (2, 1, 2, 0), (2, 2, 1, 0)]


def test_a_candidate_that_fails_is_dropped_with_its_reason() -> None:
    def failing_engine(config):
        raise MeshkitError("tp=3 does not divide the 4 heads")

    resolved = resolve(code={"model": MODEL, "layout": "auto"})
    candidate = Candidate(Layout(tp=3), {"parallel.tp": 1}, 0.01)
    measure(resolved, candidate, lambda engine: lambda: None, failing_engine)
    assert candidate.error == "MeshkitError: tp=3 does not divide the 4 heads" and candidate.step_s is None
    served = resolve(code={"model": MODEL, "layout": "auto", "strategy": "parameter_server"})
    with pytest.raises(LayoutProbeError, match="not for strategy: parameter_server: set strategy: auto"):
        choose(served, lambda engine: lambda: None, Engine)


@pytest.mark.slow
def test_plan_probe_times_the_layouts_without_training(tmp_path) -> None:
    config = tmp_path / "probe.yaml"
    probe = {"top_k": 2, "steps": 1}
    config.write_text(yaml.safe_dump({"model": MODEL, "train": {"micro_batch_size": 2, "seq_len": 64}, "probe": probe}))
    probed = meshkit("plan", str(config), "--probe", "--gpus-per-node", "2", timeout=240)
    assert probed.returncode == 0, probed.stderr[-3000:]
    assert "candidates probed on these ranks" in probed.stdout and "measured step" in probed.stdout
    assert f"train in it with: meshkit train {config} parallel.dp_replicate=" in probed.stdout
    bare = meshkit("plan", "--params", "1e9", "--layers", "8", "--hidden", "1024", "--heads", "8", "--probe")
    assert bare.returncode == 2 and "--probe runs the model: give a meshkit YAML" in bare.stderr


def _loop(rank: int, layout: str, values: dict) -> dict:
    """A hand-written loop: the reference GPT, AdamW, a DataLoader of token windows, 3 optimizer steps."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (64, 65), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    loader = DataLoader(data, batch_size=values.get("train", {}).get("micro_batch_size", 2))  # by hand: as chosen

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    overrides = {"probe": {"top_k": 3, "steps": 1}, "hang_doctor": False, **values}
    with Engine(layout=layout, **overrides) as engine:
        model, optimizer, loader = engine.prepare(model, optimizer, loader, loss_fn=loss_fn)
        batches = iter(loader)
        while engine.step < 3:
            engine.train_step(next(batches))
        weights = engine.full_state_dict(model)
        assert all(not torch.equal(weights[name], initial[name]) for name in initial)  # it did train
        probed = [c.row() for c in engine.layout_probe or []]
        return {
            "weights": weights,
            "probed": probed,
            "parallel": engine.config.parallel.model_dump(),
            "mb": loader.batch_size,
        }


@pytest.mark.slow
def test_engine_layout_auto_in_a_hand_written_loop_trains_as_the_chosen_layout_by_hand() -> None:
    auto = run_world(_loop, 4, "auto", {}, timeout=300)
    probed = auto[0]["probed"]
    ran = [c for c in probed if c["error"] is None]
    assert len(ran) >= 2 and all(c["values"]["train.micro_batch_size"] for c in probed)
    chosen = min(ran, key=lambda c: c["step_s"])["values"]
    assert auto[0]["parallel"]["tp"] == chosen["parallel.tp"] and auto[0]["parallel"]["pp"] == chosen["parallel.pp"]
    assert auto[0]["mb"] == chosen["train.micro_batch_size"]  # the loader yields the chosen micro-batches
    by_hand = run_world(_loop, 4, "manual", nest(chosen), timeout=300)
    for name, tensor in by_hand[0]["weights"].items():
        assert torch.allclose(auto[0]["weights"][name], tensor, rtol=0, atol=0), name
    with pytest.raises(AssertionError, match="EngineError: layout: auto probes the layouts at prepare"):
        run_world(_prepare_model_only, 1, timeout=60)


def _prepare_model_only(rank: int) -> None:
    with Engine(layout="auto") as engine:
        engine.prepare(GPT(GPTConfig(**MODEL)))
