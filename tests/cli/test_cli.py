"""The `meshkit` command: config questionnaire and show, env, train (in-process and on 2 ranks)."""

from __future__ import annotations

import json

import pytest
import yaml

from meshkit.recipes.train import resolve_recipe, train
from tests.helpers.cli import ROOT, meshkit

SMALL = [
    "train.steps=4",
    "train.micro_batch_size=2",
    "train.seq_len=32",
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.max_seq_len=32",
    "train.log_every=2",
]


def test_config_questionnaire_writes_a_file_that_show_reads(tmp_path) -> None:
    path = tmp_path / "cfg.yaml"
    answers = "\n".join(["4", "2", "1", "10.0.0.1", "29511", "3", "1", "1", "bf16", "2", "yes"]) + "\n"
    proc = meshkit("config", "--config-file", str(path), stdin=answers)
    assert proc.returncode == 0, proc.stderr
    written = yaml.safe_load(path.read_text())
    assert written["launch"] == {
        "nproc_per_node": 4,
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "10.0.0.1",
        "master_port": 29511,
        "max_restarts": 3,
    }
    assert written["precision"] == "bf16" and written["grad_accum_steps"] == 2 and written["compile"]["enabled"]

    shown = meshkit("config", "show", "--config-file", str(path), "--set", "seed=9", env={"MESHKIT_TP": "1"})
    assert shown.returncode == 0, shown.stderr
    lines = {line.split("│")[1].strip(): line for line in shown.stdout.splitlines() if line.count("│") >= 3}
    assert "bf16" in lines["precision"] and "file" in lines["precision"]
    assert "9" in lines["seed"] and "flag --set seed" in lines["seed"]
    assert "env MESHKIT_TP" in lines["parallel.tp"]
    assert "default" in lines["collective_timeout_s"]


def test_config_show_rejects_unknown_keys() -> None:
    proc = meshkit("config", "show", "--set", "precison=bf16")
    assert proc.returncode == 2
    assert "unknown config key 'precison'" in proc.stderr and "did you mean 'precision'?" in proc.stderr


def test_env_reports_versions_and_backends() -> None:
    proc = meshkit("env")
    assert proc.returncode == 0, proc.stderr
    for expected in ("torch", "gloo", "cpu / gloo", "python", "collective_timeout_s", "cuda (torch build)", "nccl"):
        assert expected in proc.stdout


def test_train_in_process_writes_the_summary(tmp_path) -> None:
    run_dir = tmp_path / "run"
    summary = train(resolve_recipe(None, [*SMALL, f"logging.dir={run_dir}"]))
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk == summary
    for key in ("final_loss", "steps", "tokens_per_s", "world_size", "layout", "params_sha256"):
        assert key in on_disk
    assert on_disk["steps"] == 4 and on_disk["world_size"] == 1 and on_disk["tokens_per_s"] > 0
    assert on_disk["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    assert (on_disk["device"], on_disk["backend"], on_disk["attention"]) == ("cpu", "gloo", "sdpa")  # where it ran
    n_params = on_disk["parameters"]
    assert len(on_disk["memory"]) == 1 and on_disk["memory"][0]["params"] == 4 * n_params  # fp32, unsharded
    assert (run_dir / "loss.png").stat().st_size > 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4] and all("loss" in m for m in metrics)
    again = train(resolve_recipe(None, [*SMALL, f"logging.dir={tmp_path / 'again'}"]))
    assert again["params_sha256"] == summary["params_sha256"]  # same weights, same digest


def test_meshkit_train_launches_itself_on_two_ranks(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"launch": {"nproc_per_node": 2}}))
    proc = meshkit("train", str(config), *SMALL, f"logging.dir={tmp_path / 'r'}", timeout=180)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["layout"]["dp_replicate"] == 2
    assert [m["params"] for m in summary["memory"]] == [4 * summary["parameters"]] * 2
    assert summary["final_loss"] < summary["first_loss"]
    assert "meshkit run summary" in proc.stdout and "memory per rank" in proc.stdout
    assert "on cpu (gloo), attention sdpa" in proc.stdout  # the banner names where it runs
    for activations in summary["activations"]:  # the first micro-step, measured on every rank
        assert activations["checkpointed_blocks"] == [] and activations["blocks_saved_bytes"] > 0


@pytest.mark.slow
def test_meshkit_train_with_zero3_reports_sharded_memory(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    checkpointing = {"activation_checkpointing": {"mode": "full"}}
    config.write_text(yaml.safe_dump({"launch": {"nproc_per_node": 2}, "sharding": {"zero_stage": 3}, **checkpointing}))
    proc = meshkit("train", str(config), *SMALL, f"logging.dir={tmp_path / 'r'}", timeout=180)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and summary["layout"]["dp_shard"] == 2
    for rank_memory in summary["memory"]:
        assert rank_memory["params"] <= 4 * summary["parameters"] / 2 * 1.05  # each rank holds about half
    blocks = [f"layers.{i}" for i in range(len(summary["activations"][0]["blocks"]))]
    assert blocks and all(a["checkpointed_blocks"] == blocks for a in summary["activations"])
    assert "activations kept" in proc.stdout and "checkpointing full" in proc.stdout


def test_meshkit_train_bad_override_is_one_line(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("seed: 1\n")
    proc = meshkit("train", str(config), "train.stepz=3")
    assert proc.returncode == 2
    assert "unknown config key 'train.stepz'" in proc.stderr and "'train.steps'" in proc.stderr


def test_recipe_settings_that_cannot_train_are_one_line(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  seq_len: 64\nmodel:\n  max_seq_len: 32\n")
    proc = meshkit("train", str(config))
    assert proc.returncode == 2
    assert "train.seq_len=64 exceeds model.max_seq_len=32" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.sweep  # (in-process: tests/paramserver; under meshkit launch: its lost-worker tests)
def test_meshkit_train_through_a_parameter_server_equals_ddp(tmp_path) -> None:
    """1 server + 2 workers (sync) against DDP on 2 ranks: the same weights; the first worker reports."""
    runs = {}
    for name, extra in (
        ("ddp", {"launch": {"nproc_per_node": 2}}),
        ("ps", {"launch": {"nproc_per_node": 3}, "strategy": "parameter_server"}),
    ):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(extra))
        proc = meshkit("train", str(config), *SMALL, f"logging.dir={tmp_path / name}", timeout=180)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (json.loads((tmp_path / name / "summary.json").read_text()), proc.stdout)
    (ddp, _), (served, said) = runs["ddp"], runs["ps"]
    assert served["params_sha256"] == ddp["params_sha256"]
    assert served["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5)
    assert served["layout_description"].startswith("parameter server (1 server(s), sync)")
    assert len(served["memory"]) == 1 and served["memory"][0]["optimizer"] == 0  # the worker holds no moments
    assert served["memory"][0]["rank"] == 1  # the first worker reports (rank 0 serves)
    assert "parameter server applied" in said and "meshkit run summary" in said


def test_config_show_takes_the_config_and_overrides_as_train_does_and_prints_whole_keys(tmp_path) -> None:
    demo = ROOT / "examples" / "demo.yaml"
    proc = meshkit("config", "show", str(demo), "tp=1", "activation_checkpointing.every=2")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") >= 3}
    assert "activation_checkpointing.every" in rows and "…" not in proc.stdout  # (piped: no key cut short)
    assert " 1 " in rows["parallel.tp"] and "2" in rows["activation_checkpointing.every"]
    assert "demo.yaml" in rows["train.seq_len"]  # (the file's value, named by its source)
    only = meshkit("config", "show", "seed=3")
    assert only.returncode == 0 and "3" in {line.split("│")[1].strip(): line for line in only.stdout.splitlines()
                                            if line.count("│") >= 3}["seed"]  # fmt: skip
    missing = meshkit("config", "show", str(tmp_path / "none.yaml"))
    assert missing.returncode == 2 and "none.yaml does not exist" in missing.stderr
