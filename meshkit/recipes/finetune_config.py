"""The fine-tuning recipe's config: Axolotl-style keys, plus meshkit's own keys for the layout.

A `meshkit finetune` YAML holds the widely used Axolotl keys (`base_model`, `datasets`, `adapter`, ...) and
meshkit keys, either in a `meshkit:` block or at the top level (`zero_stage: 3`, `launch.nproc_per_node: 2`).
Axolotl keys that mean a meshkit setting (`learning_rate` -> `train.lr`) become that setting, labelled with
the Axolotl key they came from; the recipe's own keys go to `FinetuneSettings`. The usual precedence holds:
file < `MESHKIT_*` environment < launch flags < `key=value` arguments. A key that is neither, or an Axolotl
feature meshkit does not have, is one line naming it; an unsupported feature that is switched off is noted.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from meshkit.config import Section
from meshkit.data.formats import DatasetType
from meshkit.errors import brief
from meshkit.launching.cluster import cluster_settings
from meshkit.recipes.hf_base import weights_file
from meshkit.resolve import (
    ConfigError,
    ResolvedConfig,
    canonical_key,
    flatten,
    launch_flags_from_env,
    leaf_keys,
    read_config_file,
    resolve,
)
from meshkit.yaml_text import load_yaml


class DatasetEntry(Section):
    path: Path = Field(description="a JSONL file")
    type: DatasetType = Field(description="alpaca | chat_template | completion")


class FinetuneSettings(Section):
    """The recipe's own keys (Axolotl names)."""

    base_model: Path = Field(description="directory in save_pretrained layout: config.json, safetensors, tokenizer")
    base_model_config: Path | None = Field(None, description="directory of config.json; null = base_model")
    model_type: str = Field("AutoModelForCausalLM", description="AutoModelForCausalLM or a causal-LM class name")
    tokenizer_type: str | None = Field(None, description="AutoTokenizer or a tokenizer class name; null = auto")
    tokenizer_config: Path | None = Field(None, description="directory of the tokenizer files; null = base_model")
    datasets: tuple[DatasetEntry, ...] = Field(min_length=1, description="[{path, type}] JSONL files")
    val_set_size: float = Field(0.0, ge=0, description="held-out share (< 1) or count (>= 1) of the samples")
    sample_packing: bool = Field(False, description="pack samples into sequence_len rows (no cross-sample attention)")
    train_on_inputs: bool = Field(False, description="also train on prompt tokens")
    adapter: Literal["lora"] | None = Field(None, description="lora, or null for a full fine-tune")
    lora_r: int = Field(8, ge=1, description="LoRA rank")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator (scaling = alpha / r)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    lora_target_modules: tuple[str, ...] | None = Field(
        None, description="module names to adapt, e.g. [q_proj, v_proj]"
    )
    lora_target_linear: bool = Field(False, description="adapt every Linear layer except the output head")
    num_epochs: float = Field(1.0, gt=0, description="epochs, when max_steps is not set")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="after linear warm-up")
    optimizer: Literal["adamw_torch", "adamw_torch_fused", "adamw", "sgd"] = Field("adamw_torch")
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)
    eval_steps: int | None = Field(None, ge=1, description="evaluate every N steps; null = at the end only")
    generation_samples: int = Field(3, ge=0, description="validation prompts answered (greedy) in the summary")
    generation_max_new_tokens: int = Field(24, ge=1, description="tokens generated per sample")

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value


def _precision_from(flag: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if value in (True, "true", "True"):
            return flag
        if value == "auto":
            return "bf16" if _bf16_available() else "no"
        return None  # false: leaves precision to other keys

    return convert


def _bf16_available() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _checkpointing(value: Any) -> Any:
    return "full" if value in (True, "true", "True") else "none"


def _auto_resume(value: Any) -> Any:
    return "auto" if value in (True, "true", "True") else None


# Axolotl key -> (meshkit key, conversion of the value; a conversion returning None sets nothing)
MAPPED: Mapping[str, tuple[str, Callable[[Any], Any] | None]] = {
    "sequence_len": ("train.seq_len", None),
    "micro_batch_size": ("train.micro_batch_size", None),
    "gradient_accumulation_steps": ("grad_accum_steps", None),
    "max_steps": ("train.steps", None),
    "learning_rate": ("train.lr", None),
    "warmup_steps": ("train.warmup_steps", None),
    "weight_decay": ("train.weight_decay", None),
    "logging_steps": ("train.log_every", None),
    "max_grad_norm": ("max_grad_norm", None),
    "seed": ("seed", None),
    "output_dir": ("logging.dir", None),
    "save_steps": ("checkpoint.every_steps", None),
    "save_total_limit": ("checkpoint.keep_last", None),
    "resume_from_checkpoint": ("checkpoint.resume", None),
    "auto_resume_from_checkpoints": ("checkpoint.resume", _auto_resume),
    "bf16": ("precision", _precision_from("bf16")),
    "fp16": ("precision", _precision_from("fp16")),
    "gradient_checkpointing": ("activation_checkpointing.mode", _checkpointing),
}
RECIPE_KEYS = frozenset(FinetuneSettings.model_fields)

# Axolotl features meshkit does not have, and what to do instead.
UNSUPPORTED: Mapping[str, str] = {
    "load_in_8bit": "quantised base models are not supported; train in bf16 or fp32",
    "load_in_4bit": "quantised base models (QLoRA) are not supported; use adapter: lora on a bf16 model",
    "flash_attention": "meshkit runs the model's default attention (sdpa); remove the key",
    "sdp_attention": "meshkit runs the model's default attention (sdpa); remove the key",
    "xformers_attention": "xformers attention is not supported; remove the key",
    "deepspeed": "set the layout in the meshkit: block (zero_stage: 3, offload: cpu, ...)",
    "fsdp": "set the layout in the meshkit: block (zero_stage: 3)",
    "fsdp_config": "set the layout in the meshkit: block (zero_stage: 3, reshard_after_forward, ...)",
    "torch_compile": "set compile: true in the meshkit: block",
    "tf32": "TF32 matmuls are torch's setting; remove the key",
    "special_tokens": "the base model's tokenizer is used as is; add tokens to it before fine-tuning",
    "tokens": "the base model's tokenizer is used as is; add tokens to it before fine-tuning",
    "chat_template": "the tokenizer's own chat template is used; set it in the base model's tokenizer",
    "dataset_prepared_path": "datasets are tokenized at start, not cached; remove the key",
    "lora_modules_to_save": "only LoRA adapter weights train; use a full fine-tune to train other modules",
    "lora_model_dir": "continuing a saved adapter is not supported; start from base_model",
    "peft_use_dora": "DoRA is not supported; use plain LoRA",
    "peft_use_rslora": "rank-stabilised LoRA is not supported; use plain LoRA",
    "lora_fan_in_fan_out": "set by the model's layer type automatically; remove the key",
    "unfrozen_parameters": "use a full fine-tune or LoRA",
    "eval_sample_packing": "evaluation uses the same packing as training; remove the key",
    "pad_to_sequence_len": "batches are padded to their longest sample (packed rows are sequence_len); remove it",
    "group_by_length": "not supported; remove the key",
    "warmup_ratio": "use warmup_steps",
    "evals_per_epoch": "use eval_steps",
    "saves_per_epoch": "use save_steps",
    "wandb_project": "trackers are jsonl and tensorboard (logging.trackers in the meshkit: block)",
    "wandb_entity": "trackers are jsonl and tensorboard (logging.trackers in the meshkit: block)",
    "wandb_watch": "trackers are jsonl and tensorboard (logging.trackers in the meshkit: block)",
    "wandb_name": "trackers are jsonl and tensorboard (logging.trackers in the meshkit: block)",
    "wandb_log_model": "trackers are jsonl and tensorboard (logging.trackers in the meshkit: block)",
    "hub_model_id": "no hub access: the merged model is written to output_dir/merged",
    "trust_remote_code": "only transformers' own model classes are loaded",
    "strict": "meshkit is always strict about keys; remove the key",
    "early_stopping_patience": "not supported; remove the key",
}
RECIPE_DEFAULTS: Mapping[str, Any] = {
    "train.seq_len": 512,
    "train.micro_batch_size": 2,
    "train.lr": 2e-4,
    "train.warmup_steps": 0,
    "train.log_every": 1,
    "logging.dir": "outputs/finetune",
}


@dataclass(frozen=True)
class FinetuneJob:
    """Everything a fine-tune needs: meshkit's resolved config, the recipe's settings and what was noted."""

    resolved: ResolvedConfig
    settings: FinetuneSettings
    recipe_sources: Mapping[str, str]
    notes: tuple[str, ...] = ()

    def steps_given(self) -> bool:
        return self.resolved.sources["train.steps"] != "default"


def _is_off(value: Any) -> bool:
    return value in (None, False, "", [], {}, "false", "False", 0)


class _Split:
    """Sorts one source's keys into recipe settings and meshkit settings (translating Axolotl keys)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.recipe: dict[str, Any] = {}
        self.meshkit: dict[str, Any] = {}
        self.labels: dict[str, str] = {}
        self.notes: list[str] = []

    def add(self, name: str, value: Any) -> None:
        if name in RECIPE_KEYS:
            self.recipe[name] = value
        elif name in MAPPED:
            key, convert = MAPPED[name]
            converted = convert(value) if convert else value
            if converted is not None:
                self._set(key, converted, f"{self.source} ({name})")
        elif name in UNSUPPORTED:
            if not _is_off(value):
                raise ConfigError(f"Axolotl key '{name}' ({self.source}) is not supported: {UNSUPPORTED[name]}")
            self.notes.append(f"'{name}: {value}' asks for nothing meshkit lacks; ignored")
        elif name == "meshkit":
            if not isinstance(value, Mapping):
                raise ConfigError(f"'meshkit' ({self.source}) must be a mapping of meshkit keys")
            for key, item in flatten(value, self.source).items():
                self._set(key, item, self.source)
        else:
            self._set(self._meshkit_key(name), value, self.source)

    def _set(self, key: str, value: Any, label: str) -> None:
        if key in self.meshkit and self.labels[key] != label and self.meshkit[key] != value:
            raise ConfigError(f"'{key}' is set twice ({self.labels[key]} and {label}): keep one")
        self.meshkit[key], self.labels[key] = value, label

    def _meshkit_key(self, name: str) -> str:
        try:
            return canonical_key(name, self.source)
        except ConfigError:
            known = sorted(RECIPE_KEYS | set(MAPPED) | {k.rsplit(".", 1)[-1] for k in leaf_keys()})
            close = difflib.get_close_matches(name[:100], known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "see the key table in the README"
            raise ConfigError(
                f"unknown key {brief(name)} ({self.source}): neither an Axolotl key meshkit supports nor a "
                f"meshkit key; {hint}"
            ) from None


def _split_file(path: Path, data: Mapping[str, Any]) -> _Split:
    split = _Split(f"file {path}")
    for name, value in data.items():
        split.add(str(name), value)
    return split


def _split_arguments(assignments: list[str]) -> _Split:
    split = _Split("argument")
    for item in assignments:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"argument '{item}' is not KEY=VALUE (e.g. learning_rate=1e-4 or zero_stage=3)")
        split.source = f"argument {name.strip()}"
        try:
            value = load_yaml(raw) if raw.strip() else None
        except Exception:
            value = raw
        split.add(name.strip(), value)
    return split


def resolve_finetune(
    config_file: str | os.PathLike[str],
    assignments: list[str],
    env: Mapping[str, str] | None = None,
    *,
    cluster: bool = False,
) -> FinetuneJob:
    """Read the YAML and the `key=value` arguments into a `FinetuneJob` (see the module docstring); `cluster`:
    this process launches, so a scheduler's variables (SLURM, PyTorchJob) count too."""
    env = os.environ if env is None else env
    path = Path(config_file)
    from_file = _split_file(path, read_config_file(path))
    from_args = _split_arguments(assignments)
    recipe = {**from_file.recipe, **from_args.recipe}
    sources = {key: (f"argument {key}" if key in from_args.recipe else f"file {path}") for key in recipe}
    try:
        settings = FinetuneSettings.model_validate(recipe)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        reason = first["msg"].removeprefix("Value error, ")
        where = sources.get(key.split(".")[0], "missing")
        raise ConfigError(f"'{key}' ({where}): {reason}") from None
    derived = {**RECIPE_DEFAULTS, "sharding.init_from": str(weights_file(settings.base_model))}
    file_values = {**derived, **from_file.meshkit}
    file_labels = {**{key: "finetune default" for key in RECIPE_DEFAULTS}, **from_file.labels}
    file_labels.setdefault("sharding.init_from", f"{sources['base_model']} (base_model)")
    flags, labels = launch_flags_from_env(env)
    flags.update(from_args.meshkit)
    labels.update(from_args.labels)
    resolved = resolve(
        flags=flags,
        flag_labels=labels,
        env=env,
        file=path,
        file_values=file_values,
        file_labels=file_labels,
        cluster=cluster_settings(env) if cluster else None,
    )
    return FinetuneJob(resolved, settings, sources, tuple(from_file.notes + from_args.notes))
