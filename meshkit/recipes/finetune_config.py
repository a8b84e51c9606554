"""The fine-tuning recipe's config: an Axolotl config as written, plus meshkit's own keys for the layout.

A `meshkit finetune` YAML holds Axolotl keys (`base_model`, `datasets`, `adapter`, `deepspeed`, ...) and meshkit
keys, either in a `meshkit:` block or at the top level (`zero_stage: 3`, `launch.nproc_per_node: 2`). Every Axolotl
key is looked up in one table (`meshkit.config.importing.axolotl.keys`): honoured keys become meshkit settings, labelled
with the Axolotl key they came from, or recipe settings (`FinetuneSettings`); noted keys give one notice line;
refused keys one error line naming what to do. The usual precedence holds: file < `MESHKIT_*` environment <
launch flags < `key=value` arguments. A key that is neither Axolotl's nor meshkit's is refused with a did-you-mean.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from meshkit.config.importing.axolotl.further_keys import DATASET_KEY_RULES
from meshkit.config.importing.axolotl.keys import AXOLOTL_KEYS, is_empty, is_off
from meshkit.config.importing.axolotl.layout import Sink
from meshkit.config.importing.result import ImportingError
from meshkit.config.resolve import (
    ConfigError,
    ResolvedConfig,
    canonical_key,
    flatten,
    launch_flags_from_env,
    leaf_keys,
    read_config_file,
    resolve,
)
from meshkit.config.yaml_text import load_yaml
from meshkit.core.errors import brief
from meshkit.data.dataset_entry import STEPWISE_KEYS, is_stepwise_type
from meshkit.launching.cluster import cluster_settings
from meshkit.recipes.finetune_settings import FinetuneSettings
from meshkit.recipes.hf_base import weights_file

RECIPE_KEYS = frozenset(FinetuneSettings.model_fields)
DATASET_LISTS = ("datasets", "test_datasets", "pretraining_dataset")
# gradient_checkpointing: true with selective_checkpointing: true asks for selective recomputation
REFINED = {("activation_checkpointing.mode", "full", "selective")}
REFINED_TO = {"activation_checkpointing.mode": "selective"}
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


class _Split:
    """Sorts one source's keys into recipe settings and meshkit settings through the key table."""

    def __init__(self, source: str, base_dir: Path) -> None:
        self.source = source
        self.recipe: dict[str, Any] = {}
        self.meshkit: dict[str, Any] = {}
        self.labels: dict[str, str] = {}
        self.notes: list[str] = []
        self.nested = Sink(base_dir=base_dir)  # what deepspeed:/fsdp_config: files set, below the keys themselves

    def add(self, name: str, value: Any) -> None:
        rule = AXOLOTL_KEYS.get(name)
        if rule is None:
            self._set(self._meshkit_key(name), value, self.source)
            return
        if is_empty(value):
            return  # Axolotl writes `key:` for unset
        shown = f"{name}: {brief(value, 40)} ({self.source})"
        if rule.kind == "refused":
            if not (is_off(value) or value in rule.off):
                raise ConfigError(f"Axolotl key {shown} is not supported: {rule.effect}")
        elif rule.kind == "noted":
            if not is_off(value):
                self.notes.append(f"{shown} has no effect here: {rule.effect}")
        elif name == "meshkit":
            if not isinstance(value, Mapping):
                raise ConfigError(f"'meshkit' ({self.source}) must be a mapping of meshkit keys")
            for key, item in flatten(value, self.source).items():
                self._set(key, item, self.source)
        elif rule.reader is not None:
            try:
                rule.reader(name, value, self.nested)
            except ImportingError as err:
                raise ConfigError(f"{err} ({self.source})") from None
        elif rule.to == "recipe" or (rule.to or "").startswith("recipe."):
            if name in DATASET_LISTS:
                value = self._dataset_entries(name, value)
            converted = rule.convert(value) if rule.convert else value
            if converted is not None:
                self.recipe[name if rule.to == "recipe" else str(rule.to).removeprefix("recipe.")] = converted
        else:
            converted = rule.convert(value) if rule.convert else value
            if converted is not None:
                self._set(str(rule.to), converted, f"{self.source} ({name})")

    def _dataset_entries(self, name: str, value: Any) -> Any:
        """A dataset list's entries without the keys meshkit notes (one line each) or refuses (one error)."""
        if not isinstance(value, list):
            return value
        entries = []
        for index, entry in enumerate(value):
            if isinstance(entry, Mapping):
                kept = {}
                stepwise = is_stepwise_type(entry.get("type") or "")
                for key, item in entry.items():
                    rule = None if stepwise and key in STEPWISE_KEYS else DATASET_KEY_RULES.get(str(key))
                    if rule is None or is_empty(item):
                        kept[key] = item
                        continue
                    shown = f"{name}[{index}].{key}: {brief(item, 40)} ({self.source})"
                    if rule.kind == "refused" and not is_off(item):
                        raise ConfigError(f"Axolotl key {shown} is not supported: {rule.effect}")
                    if rule.kind == "noted" and not is_off(item):
                        self.notes.append(f"{shown} has no effect here: {rule.effect}")
                entry = kept
            entries.append(entry)
        return entries

    def finish(self) -> None:
        """What nested files set joins below the keys set directly; trackers asked for join logging.trackers."""
        for key, value in self.nested.values.items():
            if key not in self.meshkit:
                self.meshkit[key], self.labels[key] = value, f"{self.source} ({self.nested.origins[key]})"
        if self.nested.trackers and "logging.trackers" not in self.meshkit:
            names = tuple(dict.fromkeys(("jsonl", *self.nested.trackers)))
            self.meshkit["logging.trackers"] = names
            self.labels["logging.trackers"] = f"{self.source} ({', '.join(self.nested.trackers)} keys)"
        self.recipe = {**self.nested.recipe, **self.recipe}
        self.notes.extend(self.nested.notes)

    def _set(self, key: str, value: Any, label: str) -> None:
        if (key, self.meshkit.get(key), value) in REFINED or (key, value, self.meshkit.get(key)) in REFINED:
            self.meshkit[key], self.labels[key] = REFINED_TO[key], label  # (one Axolotl key refines another's)
            return
        if key in self.meshkit and self.labels[key] != label and self.meshkit[key] != value:
            raise ConfigError(f"'{key}' is set twice ({self.labels[key]} and {label}): keep one")
        self.meshkit[key], self.labels[key] = value, label

    def _meshkit_key(self, name: str) -> str:
        try:
            return canonical_key(name, self.source)
        except ConfigError:
            known = sorted(set(AXOLOTL_KEYS) | {k.rsplit(".", 1)[-1] for k in leaf_keys()})
            close = difflib.get_close_matches(name[:100], known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "see the key table in docs/fine-tuning.md"
            raise ConfigError(
                f"unknown key {brief(name)} ({self.source}): neither an Axolotl key nor a meshkit key; {hint}"
            ) from None


def _split_file(path: Path, data: Mapping[str, Any]) -> _Split:
    split = _Split(f"file {path}", path.parent)
    for name, value in data.items():
        split.add(str(name), value)
    split.finish()
    return split


def _split_arguments(assignments: list[str]) -> _Split:
    split = _Split("argument", Path("."))
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
    split.finish()
    return split


def _accumulation_from_batch_size(
    settings: FinetuneSettings, given: Mapping[str, Any], values: dict[str, Any], labels: dict[str, str], sources: Any
) -> None:
    """Axolotl's older `batch_size` (a rank's samples per optimizer step): gradient_accumulation_steps =
    batch_size // micro_batch_size, unless gradient_accumulation_steps is given (which wins, as in Axolotl)."""
    if settings.batch_size is None or "grad_accum_steps" in given:
        return
    micro = given["train.micro_batch_size"]
    if not isinstance(micro, int):
        raise ConfigError("batch_size needs one micro_batch_size for every rank: set gradient_accumulation_steps")
    values["grad_accum_steps"] = max(1, settings.batch_size // micro)
    labels["grad_accum_steps"] = (
        f"{sources['batch_size']} (batch_size {settings.batch_size} // micro_batch_size {micro})"
    )


def _exclusive(settings: FinetuneSettings, meshkit: Mapping[str, Any]) -> None:
    """Pairs of keys that say the same thing two ways (Axolotl refuses them too)."""
    for recipe_key, meshkit_key, axolotl_name in (
        ("warmup_ratio", "train.warmup_steps", "warmup_steps"),
        ("saves_per_epoch", "checkpoint.every_steps", "save_steps"),
    ):
        if getattr(settings, recipe_key) is not None and meshkit_key in meshkit:
            raise ConfigError(f"set {recipe_key} or {axolotl_name}, not both")


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
    _exclusive(settings, {**from_file.meshkit, **from_args.meshkit})
    weights = weights_file(settings.base_model)
    # a quantized base (or a reward model's) is loaded by transformers; a plain one streams into this rank's shards
    streams = not settings.loads_whole and not settings.reinit_weights  # (reinit: the model's own initialisation)
    derived = {**RECIPE_DEFAULTS, **({"sharding.init_from": str(weights)} if streams else {})}
    file_values = {**derived, **from_file.meshkit}
    file_labels = {**{key: "finetune default" for key in RECIPE_DEFAULTS}, **from_file.labels}
    _accumulation_from_batch_size(settings, {**file_values, **from_args.meshkit}, file_values, file_labels, sources)
    if streams:
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


def check_finetune_inputs(settings: Any) -> None:
    """The launcher's look at the data before any worker starts: every dataset's path exists, or its hub name is
    cached here or within reach."""
    from meshkit.data.sources import check_reachable

    for entry in (*settings.datasets, *(settings.pretraining_dataset or ()), *(settings.test_datasets or ())):
        check_reachable(entry)
