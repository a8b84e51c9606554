"""DeepSpeed config keys (ds_config.json) as meshkit settings; see `meshkit.config.importing`."""

from __future__ import annotations

from typing import Any

from meshkit.config.importing.result import Imported, ImportingError

_TUNING = "a DeepSpeed tuning knob; meshkit sizes its own buffers"
_DS_IGNORED = {
    "steps_per_print": None,  # mapped below
    "wall_clock_breakdown": "per-phase timing; meshkit's summary and bench/ report step times",
    "optimizer": "the optimizer is the one your script builds (any torch optimizer)",
    "scheduler": "the scheduler is the one your script builds (prepare() steps it with the optimizer)",
    "zero_allow_untested_optimizer": "any torch optimizer works with meshkit's ZeRO",
    "activation_checkpointing": "use meshkit's activation_checkpointing.mode (full | selective) instead",
    "flops_profiler": "no profiler; meshkit train reports tokens/s and MFU in bench/overhead.py",
    "tensorboard": "use logging.trackers: [tensorboard]",
    "wandb": "use logging.trackers: [wandb]",
    "comms_logger": "no communication logger; meshkit bench comm measures collectives",
}


def read_deepspeed(data: dict[str, Any], out: Imported, prefix: str = "", world: int | None = None) -> None:
    """DeepSpeed keys into `out` (`prefix` names the enclosing file in the origins)."""

    def origin(key: str) -> str:
        return f"{prefix}{key}"

    def plain(key: str, value: Any, target: str) -> None:
        if value == "auto":
            out.notes.append(f"{origin(key)}: auto — meshkit's {target} applies")
        else:
            out.set(target, value, origin(key))

    zero = data.get("zero_optimization", {})
    if "stage" in zero:
        plain("zero_optimization.stage", zero["stage"], "sharding.zero_stage")
    stage = zero.get("stage") if zero.get("stage") != "auto" else None
    for part in ("offload_optimizer", "offload_param"):
        block = zero.get(part) or {}
        device = str(block.get("device", "none")).lower()
        key = f"zero_optimization.{part}.device"
        if device == "cpu":
            if stage == 3:
                out.set("sharding.offload", "cpu", origin(key))
            else:
                out.skip(origin(key), "meshkit offloads to the CPU with zero_stage 3 (FSDP CPU offload): set stage 3")
        elif device == "nvme":
            if part == "offload_param":
                out.skip(origin(key), "meshkit puts optimizer states on NVMe, not parameters: offload the optimizer")
            else:
                out.set("sharding.offload", "nvme", origin(key))
                if block.get("nvme_path"):
                    out.set("sharding.offload_dir", block["nvme_path"], origin(f"zero_optimization.{part}.nvme_path"))
        for extra in sorted(set(block) - {"device", "nvme_path"}):
            out.skip(origin(f"zero_optimization.{part}.{extra}"), "meshkit pins and buffers offloaded memory itself")
    for extra in sorted(set(zero) - {"stage", "offload_optimizer", "offload_param"}):
        out.skip(origin(f"zero_optimization.{extra}"), _TUNING)
    for name in ("bf16", "fp16"):
        block = data.get(name) or {}
        if block.get("enabled") is True:
            out.set("precision", name, origin(f"{name}.enabled"))
        for extra in sorted(set(block) - {"enabled"}):
            out.skip(origin(f"{name}.{extra}"), "meshkit's fp16 loss scale is dynamic (torch's GradScaler)")
    if "train_micro_batch_size_per_gpu" in data:
        plain("train_micro_batch_size_per_gpu", data["train_micro_batch_size_per_gpu"], "train.micro_batch_size")
    if "gradient_accumulation_steps" in data:
        plain("gradient_accumulation_steps", data["gradient_accumulation_steps"], "grad_accum_steps")
    if "gradient_clipping" in data:
        plain("gradient_clipping", data["gradient_clipping"], "max_grad_norm")
    if "steps_per_print" in data:
        out.set("train.log_every", data["steps_per_print"], origin("steps_per_print"))
    _global_batch(data, out, origin, world)
    known = {
        "zero_optimization",
        "bf16",
        "fp16",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "train_batch_size",
        *_DS_IGNORED,
    }
    for key in sorted(set(data) - known):
        out.skip(origin(key), "not a DeepSpeed setting meshkit knows")
    for key, why in _DS_IGNORED.items():
        if why and key in data:
            out.skip(origin(key), why)


def _global_batch(data: dict[str, Any], out: Imported, origin: Any, world: int | None) -> None:
    """train_batch_size = micro × accumulation × world: checked, or solved for the micro-batch."""
    total = data.get("train_batch_size")
    if total in (None, "auto"):
        return
    accum = out.values.get("grad_accum_steps", 1)
    micro = out.values.get("train.micro_batch_size")
    if world is None:
        out.notes.append(
            f"{origin('train_batch_size')}={total} is micro × accumulation × world: pass --world N to derive "
            "train.micro_batch_size"
        )
        return
    if micro is None:
        if total % (accum * world):
            raise ImportingError(
                f"{origin('train_batch_size')}={total} does not divide into gradient_accumulation_steps={accum} × "
                f"world {world}: fix one of them"
            )
        out.set(
            "train.micro_batch_size",
            total // (accum * world),
            f"{origin('train_batch_size')} / (accumulation × world {world})",
        )
    elif micro * accum * world != total:
        raise ImportingError(
            f"{origin('train_batch_size')}={total} but micro {micro} × accumulation {accum} × world {world} = "
            f"{micro * accum * world}: fix one of them"
        )
