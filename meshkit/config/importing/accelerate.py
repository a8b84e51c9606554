"""Accelerate config keys (the YAML `accelerate config` writes) as meshkit settings; see `meshkit.config.importing`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshkit.config.importing.result import Imported, ImportingError

_NOT_NEEDED = {
    "compute_environment": "meshkit runs where it is launched (meshkit launch; SLURM and PyTorchJob are read)",
    "main_training_function": "meshkit launches your script as it is",
    "rdzv_backend": "meshkit uses torch's c10d rendezvous",
    "same_network": "every node dials the master address; --local-addr names this node's",
    "downcast_bf16": "TPU only",
    "gpu_ids": "one process per device; restrict devices with CUDA_VISIBLE_DEVICES",
    "debug": "meshkit's hang doctor names stalled ranks (hang_doctor: true)",
    "enable_cpu_affinity": "meshkit pins each rank to its share of cores (threads_per_process)",
}
_FSDP_NOT_NEEDED = {
    "fsdp_auto_wrap_policy": "meshkit wraps the repeated blocks it finds (or `blocks:`)",
    "fsdp_transformer_layer_cls_to_wrap": "meshkit finds the repeated blocks (set `blocks:` to name them)",
    "fsdp_use_orig_params": "meshkit's FSDP2 keeps the original parameters",
    "fsdp_state_dict_type": "checkpoints are sharded and reshardable; engine.save_model exports full safetensors",
    "fsdp_sync_module_states": "every rank starts from the same seed or from sharding.init_from",
    "fsdp_cpu_ram_efficient_loading": "build the model on the meta device and set sharding.init_from",
    "fsdp_version": "meshkit uses FSDP2 (fully_shard)",
    "fsdp_backward_prefetch": "meshkit prefetches one block in backward (sharding.backward_prefetch to change)",
    "fsdp_min_num_params": "meshkit wraps the repeated blocks it finds (with SIZE_BASED_WRAP: sharding.unit_mb)",
}
_SHARDING = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "HYBRID_SHARD_ZERO2": 2}


def read_accelerate(
    data: dict[str, Any], out: Imported, read_deepspeed_file: Callable[[str, int | None], None]
) -> None:
    kind = str(data.get("distributed_type", "NO")).upper()
    machines = int(data.get("num_machines", 1) or 1)
    processes = int(data.get("num_processes", 1) or 1)
    if processes % machines:
        raise ImportingError(f"num_processes={processes} does not divide over num_machines={machines}")
    out.set("launch.nnodes", machines, "num_machines")
    out.set("launch.nproc_per_node", processes // machines, "num_processes / num_machines")
    for key, target in (
        ("machine_rank", "launch.node_rank"),
        ("main_process_ip", "launch.master_addr"),
        ("main_process_port", "launch.master_port"),
    ):
        if data.get(key) not in (None, ""):
            out.set(target, data[key], key)
    precision = str(data.get("mixed_precision", "no")).lower()
    if precision in ("no", "bf16", "fp16"):
        out.set("precision", precision, "mixed_precision")
    else:
        out.skip("mixed_precision", f"{precision} is not supported: use bf16")
    if data.get("use_cpu"):
        out.set("device", "cpu", "use_cpu")
    _dynamo(data.get("dynamo_config") or {}, out)
    if kind == "FSDP":
        read_fsdp_config(data.get("fsdp_config") or {}, out, machines)
    elif kind == "DEEPSPEED":
        read_deepspeed_block(data.get("deepspeed_config") or {}, out, read_deepspeed_file, processes)
    elif kind not in ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_NPU", "MULTI_XPU"):
        out.skip("distributed_type", f"{kind} is not supported: meshkit runs DDP, ZeRO/FSDP, tp, pp, cp")
    for key, why in _NOT_NEEDED.items():
        if key in data:
            out.skip(key, why)
    known = {
        "distributed_type",
        "num_machines",
        "num_processes",
        "machine_rank",
        "main_process_ip",
        "main_process_port",
        "mixed_precision",
        "use_cpu",
        "dynamo_config",
        "fsdp_config",
        "deepspeed_config",
        *_NOT_NEEDED,
    }
    for key in sorted(set(data) - known):
        if not key.startswith("tpu_"):
            out.skip(key, "not an Accelerate setting meshkit knows")
        elif data[key] not in (None, False, "", []):
            out.skip(key, "TPU only")


def _dynamo(block: dict[str, Any], out: Imported) -> None:
    backend = str(block.get("dynamo_backend", "NO")).lower()
    if backend != "no":
        out.set("compile.enabled", True, "dynamo_config.dynamo_backend")
        out.set("compile.backend", backend, "dynamo_config.dynamo_backend")
    for key, target in (
        ("dynamo_mode", "compile.mode"),
        ("dynamo_use_fullgraph", "compile.fullgraph"),
        ("dynamo_use_dynamic", "compile.dynamic"),
    ):
        if key in block and backend != "no":
            out.set(target, block[key], f"dynamo_config.{key}")


def read_fsdp_config(block: dict[str, Any], out: Imported, machines: int) -> None:
    """An FSDP config block (`fsdp_*` keys, as Accelerate writes them) into `out`; HYBRID shards inside a node."""
    strategy = str(block.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    strategy = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD"}.get(strategy, strategy)
    if strategy not in _SHARDING:
        out.skip("fsdp_config.fsdp_sharding_strategy", f"{strategy} is not known")
    else:
        out.set("sharding.zero_stage", _SHARDING[strategy], "fsdp_config.fsdp_sharding_strategy")
        if strategy.startswith("HYBRID"):  # shard inside a node, replicate across nodes
            out.set(
                "parallel.dp_replicate", machines, "fsdp_config.fsdp_sharding_strategy (HYBRID: one replica per node)"
            )
            out.set("parallel.dp_shard", -1, "fsdp_config.fsdp_sharding_strategy (HYBRID: shards inside a node)")
    if block.get("fsdp_offload_params") in (True, "true", "True"):
        out.set("sharding.offload", "cpu", "fsdp_config.fsdp_offload_params")
    if block.get("fsdp_activation_checkpointing") in (True, "true", "True"):
        out.set("activation_checkpointing.mode", "full", "fsdp_config.fsdp_activation_checkpointing")
    if block.get("fsdp_forward_prefetch") in (True, "true", "True"):
        out.set("sharding.forward_prefetch", 1, "fsdp_config.fsdp_forward_prefetch")
    if "fsdp_reshard_after_forward" in block:
        value = block["fsdp_reshard_after_forward"]
        out.set(
            "sharding.reshard_after_forward",
            value in (True, "true", "True", "FULL_SHARD"),
            "fsdp_config.fsdp_reshard_after_forward",
        )
    sized = str(block.get("fsdp_auto_wrap_policy", "")).upper() == "SIZE_BASED_WRAP"
    if sized and block.get("fsdp_min_num_params") and _SHARDING.get(strategy) == 3:
        # units of about that many fp32 parameters: meshkit groups whole blocks up to the size
        unit_mb = 4 * int(block["fsdp_min_num_params"]) / 1e6
        out.set("sharding.unit_mb", unit_mb, "fsdp_config.fsdp_min_num_params (SIZE_BASED_WRAP, 4 bytes each)")
        block = {key: value for key, value in block.items() if key != "fsdp_min_num_params"}
    handled = {
        "fsdp_sharding_strategy",
        "fsdp_offload_params",
        "fsdp_activation_checkpointing",
        "fsdp_forward_prefetch",
        "fsdp_reshard_after_forward",
        *_FSDP_NOT_NEEDED,
    }
    for key in sorted(block):
        if key in _FSDP_NOT_NEEDED:
            out.skip(f"fsdp_config.{key}", _FSDP_NOT_NEEDED[key])
        elif key not in handled:
            out.skip(f"fsdp_config.{key}", "not an FSDP setting meshkit knows")


def read_deepspeed_block(
    block: dict[str, Any], out: Imported, read_file: Callable[[str, int | None], None], world: int
) -> None:
    """Accelerate's `deepspeed_config` block (the fields of its DeepSpeedPlugin) into `out`."""
    if block.get("deepspeed_config_file"):
        read_file(block["deepspeed_config_file"], world)
        return
    mapped = {
        "zero_stage": "sharding.zero_stage",
        "gradient_accumulation_steps": "grad_accum_steps",
        "gradient_clipping": "max_grad_norm",
    }
    for key, target in mapped.items():
        if key in block and block[key] != "auto":
            out.set(target, block[key], f"deepspeed_config.{key}")
    stage = block.get("zero_stage")
    for key in ("offload_optimizer_device", "offload_param_device"):
        device = str(block.get(key, "none")).lower()
        if device == "cpu" and stage == 3:
            out.set("sharding.offload", "cpu", f"deepspeed_config.{key}")
        elif device == "cpu":
            out.skip(f"deepspeed_config.{key}", "meshkit offloads to the CPU with zero_stage 3 (FSDP CPU offload)")
        elif device == "nvme" and key == "offload_optimizer_device":
            out.set("sharding.offload", "nvme", f"deepspeed_config.{key}")
            if block.get("offload_optimizer_nvme_path"):
                out.set(
                    "sharding.offload_dir",
                    block["offload_optimizer_nvme_path"],
                    "deepspeed_config.offload_optimizer_nvme_path",
                )
        elif device == "nvme":
            out.skip(f"deepspeed_config.{key}", "meshkit puts optimizer states on NVMe, not parameters")
    handled = {*mapped, "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path"}
    for key in sorted(set(block) - handled):
        why = (
            "meshkit builds on the meta device when the model is (sharding.init_from)"
            if key == "zero3_init_flag"
            else "a DeepSpeed setting meshkit does not take"
        )
        out.skip(f"deepspeed_config.{key}", why)
