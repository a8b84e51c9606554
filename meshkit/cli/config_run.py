"""The run a config file starts, as `meshkit estimate` / `meshkit plan` read it: a meshkit YAML (`meshkit train`'s
reference GPT) or a fine-tune config (Axolotl keys, `meshkit finetune`) gives the model's shape and the run's own
layout, precision, sequence length, micro-batch, adapter and step recipe — what the recipe would do with the same
file — so that the estimate of a config is the estimate of the run it starts. Flags given on the command line
override any of them; each value says where it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshkit.planning.estimate import CPU_RUNTIME_GB, EstimateError, ModelShape

PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class ConfigRun:
    """The estimator's arguments for the run `path` starts (`values`), the model's shape, and the run's words."""

    path: Path
    shape: ModelShape
    recipe: str  # "meshkit train" or "meshkit finetune"
    values: dict[str, Any] = field(default_factory=dict)  # estimate_memory's keywords and the step recipe's

    def merged(self, given: dict[str, Any], defaults: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """Each value: the flag where given, else the config's, else the default; and where each came from."""
        values, sources = {}, {}
        for name, default in defaults.items():
            if given.get(name) is not None:
                values[name], sources[name] = given[name], "flag"
            elif name in self.values:
                values[name], sources[name] = self.values[name], f"{self.recipe} {self.path.name}"
            else:
                values[name], sources[name] = default, "default"
        return values, sources


def is_run_config(path: Path) -> bool:
    """A YAML file that configures a run (a meshkit or fine-tune config), not a model's config.json."""
    return path.suffix in (".yaml", ".yml")


def is_finetune_config(path: Path) -> bool:
    """A YAML with `base_model`: `meshkit finetune`'s config (Axolotl keys and meshkit's); else meshkit's own."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise EstimateError(f"{path}: cannot read it as YAML ({str(error).splitlines()[0]})") from None
    return isinstance(raw, dict) and bool(raw.get("base_model"))


def config_run(path: Path) -> ConfigRun:
    """The run `path` configures (see the module text)."""
    return _finetune_run(path) if is_finetune_config(path) else _train_run(path)


def _train_run(path: Path) -> ConfigRun:
    from meshkit.config.resolve import resolve

    config = resolve(file=path).config
    run = ConfigRun(path, ModelShape.from_gpt(config.model), "meshkit train")
    run.values = _layout_values(config) | {"loss": "plain", "attention": "sdpa", "optimizer": "adam"}
    return run  # (the reference GPT's loss is its own lm_loss over the whole logits)


def _finetune_run(path: Path) -> ConfigRun:
    from meshkit.recipes.finetune_config import resolve_finetune

    job = resolve_finetune(path, [], env={})
    s, config = job.settings, job.resolved.config
    base = Path(s.base_model_config or s.base_model)
    shape = ModelShape.from_hf_config(base / "config.json" if base.is_dir() else base)
    run = ConfigRun(path, shape, "meshkit finetune")
    values = _layout_values(config)
    values["loss"] = "fused" if config.fused_loss != "off" else "plain"
    values["attention"] = s.attn_implementation or "sdpa"
    values["optimizer"] = _optimizer_kind(s.optimizer)
    if s.rl is not None:  # a preference batch holds a chosen and a rejected row per pair
        values["micro_batch"] = 2 * values["micro_batch"] if s.rl != "kto" else values["micro_batch"]
        adapters = s.adapter is not None
        values["reference"] = "precomputed" if s.precompute_ref_log_probs else "adapters" if adapters else "copy"
    if s.adapter is not None:
        values["trainable_params"] = _adapter_parameters(job)
    run.values = values
    return run


def _layout_values(config: Any) -> dict[str, Any]:
    """The layout, precision, sequence, micro-batch and recomputation the config's run gets."""
    from dataclasses import replace

    from meshkit.config.layout import Layout
    from meshkit.parallel.zero.sharding import effective_zero_stage

    try:
        dims = Layout.from_config(config.parallel, config.launch.world_size)
    except Exception as error:  # noqa: BLE001 - the config's own layout error, said in one line
        raise EstimateError(f"the config's layout: {error}") from None
    import warnings

    with warnings.catch_warnings():  # (an unsharded stage says so when the run starts; here it is just read)
        warnings.simplefilter("ignore")
        dims = replace(dims, zero_stage=effective_zero_stage(config.sharding, dims))
    shards = dims.dp_shard if dims.zero_stage == 3 and dims.dp_shard > 1 else dims.dp
    on_cpu = {"runtime_gb": CPU_RUNTIME_GB} if runs_on_cpu(config.device) else {}
    return on_cpu | {
        "dp": shards,
        "tp": dims.tp,
        "pp": dims.pp,
        "cp": dims.cp,
        "ep": dims.ep,
        "zero_stage": dims.zero_stage,
        "precision": PRECISIONS[config.precision],
        "seq_len": config.train.seq_len,
        "micro_batch": config.train.largest_micro_batch,
        "activation_checkpointing": config.activation_checkpointing.mode,
        "offload": config.sharding.offload,
        "compiled": config.compile.enabled,
        "tiled_mlp": config.tiled_mlp,
        "sequence_parallel": config.tensor_parallel.sequence_parallel if dims.tp > 1 else None,
        # sequences per optimizer step, as the planner counts them
        "global_batch": config.train.global_micro_batch(dims.dp) * config.grad_accum_steps,
    }


def runs_on_cpu(device: str) -> bool:
    """The config's run is on CPU ranks: `device: cpu`, or `auto` on a host without a GPU (as it starts here)."""
    if device == "cpu":
        return True
    import torch

    return device == "auto" and not torch.cuda.is_available()


def _optimizer_kind(name: str) -> str:
    """The estimator's optimizer kind for a fine-tune's optimizer name."""
    lowered = name.lower()
    if "sgd" in lowered:
        return "sgd"
    if "8bit" in lowered:
        return "adam8bit"
    if "4bit" in lowered:
        return "adam4bit"
    return "adam"


def _adapter_parameters(job: Any) -> float:
    """Parameters the adapters train: the recipe's own LoRA applied to the model built on the meta device."""
    from meshkit.recipes.hf_base import build_meta_model
    from meshkit.tuning.lora import apply_lora

    model = apply_lora(build_meta_model(job.settings), job.settings)
    return float(sum(param.numel() for param in model.parameters() if param.requires_grad))


def run_values(
    model: Path | None, given: dict[str, Any], defaults: dict[str, Any]
) -> tuple[ConfigRun | None, dict[str, Any], dict[str, str]]:
    """(the run `model` configures, or None where it is no run config; each value: the flag where given, else the
    config's, else the default; where each came from)."""
    run = config_run(model) if model is not None and is_run_config(model) and model.is_file() else None
    if run is not None:
        return run, *run.merged(given, defaults)
    values = {name: given[name] if given.get(name) is not None else default for name, default in defaults.items()}
    return None, values, {name: "flag" if given.get(name) is not None else "default" for name in defaults}
