"""`meshkit config import`: Accelerate and DeepSpeed configs as meshkit settings, nothing dropped silently."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml

from meshkit.config.importing import ImportingError, import_config, to_yaml
from meshkit.config.resolve import ENV_LAUNCH_FLAGS, launch_flags_to_env, resolve
from tests.helpers.cli import meshkit_here as meshkit

# seeds/000 §2.2: ZeRO-3, CPU offload of optimizer and parameters, bf16
SEED_DS = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"},
    },
    "train_batch_size": 64,
    "gradient_accumulation_steps": 4,
    "bf16": {"enabled": True},
}
SEED_DS_COMMENTED = """// ds_config.json
{
  "bf16": { "enabled": true },
  "train_micro_batch_size_per_gpu": 8,      // micro-batch per stage
  "gradient_accumulation_steps": "auto",
  "zero_optimization": { "stage": 2 },      // ZeRO 2 or 3
  "steps_per_print": 100,
  "wall_clock_breakdown": false
}
"""
ACCELERATE = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "MULTI_GPU",
    "machine_rank": 1,
    "main_process_ip": "10.0.0.1",
    "main_process_port": 29500,
    "main_training_function": "main",
    "mixed_precision": "bf16",
    "num_machines": 2,
    "num_processes": 16,
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": False,
    "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune"},
    "tpu_use_cluster": False,
}


def _resolved(values: dict, tmp_path) -> dict:
    return resolve(file_values=values, file=tmp_path / "x.yaml", env={}).config.model_dump()


def _write(tmp_path, name: str, data: object) -> object:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return path


def test_the_seed_deepspeed_config_equals_the_hand_written_meshkit_config(tmp_path) -> None:
    imported = import_config(_write(tmp_path, "ds_config.json", SEED_DS), world=2)
    by_hand = {
        "sharding": {"zero_stage": 3, "offload": "cpu"},
        "precision": "bf16",
        "grad_accum_steps": 4,
        "train": {"micro_batch_size": 8},
    }  # 64 = 8 × 4 accumulation × 2 ranks
    assert _resolved(imported.values, tmp_path) == _resolved(by_hand, tmp_path)
    assert imported.origins["train.micro_batch_size"] == "train_batch_size / (accumulation × world 2)"
    assert imported.skipped == [
        ("zero_optimization.offload_optimizer.pin_memory", "meshkit pins and buffers offloaded memory itself")
    ]


def test_comments_auto_values_and_unknown_keys_are_each_accounted_for(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(SEED_DS_COMMENTED)
    imported = import_config(path)
    assert imported.values == {
        "precision": "bf16",
        "train.micro_batch_size": 8,
        "sharding.zero_stage": 2,
        "train.log_every": 100,
    }
    assert [origin for origin, _ in imported.skipped] == ["wall_clock_breakdown"]
    assert any("gradient_accumulation_steps: auto" in note for note in imported.notes)


def test_an_inconsistent_global_batch_is_refused_in_one_line(tmp_path) -> None:
    data = {**SEED_DS, "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ImportingError, match=r"train_batch_size=64 but micro 4 × accumulation 4 × world 2 = 32"):
        import_config(_write(tmp_path, "ds.json", data), world=2)


def test_an_accelerate_config_maps_launch_precision_and_compile(tmp_path) -> None:
    imported = import_config(_write(tmp_path, "default_config.yaml", ACCELERATE))
    config = resolve(file_values=imported.values, file=tmp_path / "x.yaml", env={}).config
    assert (config.launch.nnodes, config.launch.nproc_per_node, config.launch.node_rank) == (2, 8, 1)
    assert (config.launch.master_addr, config.launch.master_port, config.precision) == ("10.0.0.1", 29500, "bf16")
    assert config.compile.enabled and config.compile.backend == "inductor" and config.compile.mode == "max-autotune"
    skipped = dict(imported.skipped)
    assert set(skipped) == {"compute_environment", "main_training_function", "rdzv_backend", "same_network"}


def test_accelerate_fsdp_and_deepspeed_with_its_file(tmp_path) -> None:
    fsdp = {
        **ACCELERATE,
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_sharding_strategy": "HYBRID_SHARD",
            "fsdp_offload_params": False,
            "fsdp_activation_checkpointing": True,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        },
    }
    imported = import_config(_write(tmp_path, "fsdp.yaml", fsdp))
    config = resolve(file_values=imported.values, file=tmp_path / "x.yaml", env={}).config
    assert config.sharding.zero_stage == 3 and config.parallel.dp_replicate == 2 and config.parallel.dp_shard == -1
    assert config.activation_checkpointing.mode == "full"
    assert "fsdp_config.fsdp_auto_wrap_policy" in dict(imported.skipped)
    sized = {**fsdp["fsdp_config"], "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 10**7}
    imported = import_config(_write(tmp_path, "sized.yaml", {**fsdp, "fsdp_config": sized}))
    config = resolve(file_values=imported.values, file=tmp_path / "x.yaml", env={}).config
    assert config.sharding.unit_mb == 40.0  # 10^7 fp32 parameters per FSDP unit
    assert "fsdp_config.fsdp_min_num_params" not in dict(imported.skipped)
    _write(tmp_path, "ds_config.json", SEED_DS)
    deepspeed = {
        **ACCELERATE,
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": True},
    }
    imported = import_config(_write(tmp_path, "ds.yaml", deepspeed))
    # 64 = micro × 4 accumulation × 16 processes (the Accelerate config's world)
    assert imported.values["train.micro_batch_size"] == 1 and imported.values["sharding.zero_stage"] == 3
    assert imported.origins["sharding.zero_stage"] == "ds_config.json: zero_optimization.stage"


@pytest.mark.slow
def test_the_command_writes_yaml_with_origins_that_meshkit_reads(tmp_path) -> None:
    source = _write(tmp_path, "ds_config.json", SEED_DS)
    out = tmp_path / "meshkit.yaml"
    proc = meshkit("config", "import", str(source), "--world", "2", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "not imported: zero_optimization.offload_optimizer.pin_memory" in proc.stderr
    text = out.read_text()
    assert "zero_stage: 3  # zero_optimization.stage" in text
    shown = meshkit("config", "show", "--config-file", str(out))
    assert shown.returncode == 0 and "offload" in shown.stdout
    assert to_yaml(import_config(source, world=2), source) == text
    printed = meshkit("config", "import", str(source), "--world", "2")
    assert printed.returncode == 0 and printed.stdout == text
    neither = _write(tmp_path, "other.yaml", {"lr": 1})
    bad = meshkit("config", "import", str(neither))
    assert bad.returncode == 2 and "neither an Accelerate config" in bad.stderr


def test_a_config_file_of_either_kind_is_converted_on_the_fly(tmp_path) -> None:
    source = _write(
        tmp_path,
        "default_config.yaml",
        {**ACCELERATE, "num_machines": 1, "num_processes": 2, "machine_rank": 0, "dynamo_config": {}},
    )
    with pytest.warns(UserWarning, match=r"not imported: compute_environment, main_training_function"):
        resolved = resolve(file=source, env={})
    assert resolved.config.launch.nproc_per_node == 2 and resolved.config.precision == "bf16"
    assert resolved.sources["launch.nproc_per_node"] == f"file {source} (num_processes / num_machines)"
    with warnings.catch_warnings():  # said once: the launcher said it, its workers (and ranks other than 0) do not
        warnings.simplefilter("error")
        resolve(file=source, env={ENV_LAUNCH_FLAGS: launch_flags_to_env({}, {})})
        resolve(file=source, env={"RANK": "1"})
    ds = _write(tmp_path, "ds_config.json", {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0})
    resolved = resolve(file=ds, env={})
    assert resolved.config.sharding.zero_stage == 2 and resolved.config.max_grad_norm == 1.0


def test_a_meshkit_config_written_as_json_stays_a_meshkit_config(tmp_path) -> None:
    path = _write(tmp_path, "run.json", {"precision": "bf16", "sharding": {"zero_stage": 1}})
    resolved = resolve(file=path, env={})
    assert resolved.config.sharding.zero_stage == 1 and resolved.sources["precision"] == f"file {path}"
