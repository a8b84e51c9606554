"""`meshkit estimate CONFIG` estimates the run that config starts: the layout, precision, sequence, micro-batch,
adapter and loss of `meshkit train` / `meshkit finetune` with the same file, each value saying where it came from;
flags override the config."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import ROOT
from tests.helpers.cli import meshkit_here as meshkit


def _run(*args: str) -> dict:
    done = meshkit("estimate", *args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)["run"]


def test_the_demo_config_gives_the_demos_own_run() -> None:
    run = _run(str(ROOT / "examples" / "demo.yaml"))
    values = {name: entry["value"] for name, entry in run.items()}
    assert values | {"sequence_parallel": True} == values  # (tp 2 with sequence parallel)
    assert (values["dp"], values["tp"], values["zero_stage"]) == (2, 2, 0)
    assert (values["precision"], values["seq_len"], values["micro_batch"]) == ("fp32", 128, 8)
    assert values["loss"] == "plain"  # (the reference GPT's own lm_loss over the whole logits)
    assert run["seq_len"]["from"] == "meshkit train demo.yaml"


def test_a_flag_overrides_the_configs_value_and_says_so() -> None:
    run = _run(str(ROOT / "examples" / "demo.yaml"), "--seq-len", "512", "--precision", "bf16")
    assert run["seq_len"] == {"value": 512, "from": "flag"}
    assert run["precision"] == {"value": "bf16", "from": "flag"}
    assert run["micro_batch"]["from"] == "meshkit train demo.yaml"


def test_a_lora_finetune_config_counts_the_adapters_and_the_fused_loss(tmp_path, material) -> None:
    pytest.importorskip("peft", reason="the hf extra (peft) is not installed")
    from tests.helpers.finetune_runs import lora_keys, write_config

    lora = write_config(tmp_path / "lora.yaml", material, **lora_keys(), meshkit={"launch": {"nproc_per_node": 2}})
    run = _run(str(lora))
    assert run["loss"]["value"] == "fused" and run["dp"]["value"] == 2 and run["seq_len"]["value"] == 256
    trained = run["trainable_params"]["value"]
    assert 0 < trained < 20_000  # (r=4 adapters on a 39k-parameter base)
    full = _run(str(write_config(tmp_path / "full.yaml", material)))
    assert full["trainable_params"]["value"] is None and full["dp"]["value"] == 1


def test_plan_reads_a_finetune_config_as_the_run_it_starts(tmp_path, material) -> None:
    from tests.helpers.finetune_runs import write_config

    config = write_config(tmp_path / "full.yaml", material, gradient_accumulation_steps=4)
    done = meshkit("plan", str(config), "--gpus-per-node", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    layouts = json.loads(done.stdout)
    assert layouts and all(row["dp"] * row["microbatches"] >= 1 for row in layouts)
    flagged = meshkit("plan", str(config), "--gpus-per-node", "2", "--seq-len", "64", "--json")
    assert json.loads(flagged.stdout)[0]["tokens_per_s"] != layouts[0]["tokens_per_s"]  # (the flag overrides)
