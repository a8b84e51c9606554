"""Layer the config sources into one `RunConfig`, remembering where every value came from.

Precedence, lowest first: defaults < YAML file < `MESHKIT_*` environment < launch flags < code arguments (a
launcher under SLURM or a PyTorchJob adds the scheduler's variables just below `MESHKIT_*`; `OMP_NUM_THREADS`
sets `threads_per_process`, also just below `MESHKIT_*`).
A key may be written as its dotted path (`parallel.tp`, `compile.mode`) or, where the name is unique, as its
leaf name (`tp`, `precision`); `compile: true` is short for `compile.enabled: true`. Environment variables
use the same names upper-cased, with `__` for the dot: `MESHKIT_TP=2`, `MESHKIT_COMPILE__MODE=max-autotune`.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from meshkit.config.importing import foreign_config
from meshkit.config.schema import RunConfig
from meshkit.config.yaml_text import load_yaml
from meshkit.core.errors import MeshkitError, brief

ENV_PREFIX = "MESHKIT_"
ENV_CONFIG_FILE = "MESHKIT_CONFIG_FILE"  # path of the YAML file (the launcher passes it to the workers)
ENV_LAUNCH_FLAGS = "MESHKIT_LAUNCH_FLAGS"  # JSON of the launch flags, so workers keep their precedence
RESERVED_ENV = frozenset({ENV_CONFIG_FILE, ENV_LAUNCH_FLAGS, "MESHKIT_RUN_ID"})
LAUNCHER_ENV_PREFIX = "MESHKIT_LAUNCHER_"  # what `meshkit launch` tells its workers (not config keys)
# Set by a launcher that chose OMP_NUM_THREADS itself (the user had not): the workers then read it as the default.
ENV_LAUNCHER_THREADS = "MESHKIT_LAUNCHER_SET_OMP_NUM_THREADS"


class ConfigError(MeshkitError):
    """A bad setting: the message is one line naming the key, its source and what to do."""


@dataclass(frozen=True)
class Conflict:
    key: str
    code_value: Any
    flag_value: Any
    flag_source: str

    def message(self) -> str:
        return (
            f"config '{self.key}': code sets {self.code_value!r}, {self.flag_source} sets {self.flag_value!r}; "
            f"using the code value {self.code_value!r}"
        )


@dataclass(frozen=True)
class ResolvedConfig:
    """The merged config, the source of each leaf key, and any code-versus-flag conflicts."""

    config: RunConfig
    sources: Mapping[str, str]
    conflicts: tuple[Conflict, ...] = ()

    def value(self, key: str) -> Any:
        node: Any = self.config
        for part in key.split("."):
            node = getattr(node, part)
        return node

    def rows(self) -> list[tuple[str, str, str]]:
        """(key, value, source) for every leaf, in schema order."""
        return [(key, _show(self.value(key)), self.sources[key]) for key in leaf_keys()]


_DEFAULTS = ResolvedConfig(config=RunConfig(), sources={})


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "[]"
    return "null" if value is None else str(value)


def _walk(model: type[BaseModel], prefix: str = "") -> list[tuple[str, bool]]:
    """(dotted key, is_section) for every field, depth first."""
    out: list[tuple[str, bool]] = []
    for name, field in model.model_fields.items():
        key = prefix + name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.append((key, True))
            out.extend(_walk(annotation, key + "."))
        else:
            out.append((key, False))
    return out


@functools.cache
def _schema() -> tuple[tuple[str, bool], ...]:
    return tuple(_walk(RunConfig))


def leaf_keys() -> list[str]:
    return [key for key, is_section in _schema() if not is_section]


def section_keys() -> list[str]:
    return [key for key, is_section in _schema() if is_section]


# Keys whose natural name is a Python keyword.
_SYNONYMS = MappingProxyType({"checkpoint.async": "checkpoint.async_save"})


@functools.cache
def _aliases() -> Mapping[str, str]:
    """Leaf names that are unique across the schema map to their dotted key."""
    by_leaf: dict[str, list[str]] = {}
    for key in leaf_keys():
        by_leaf.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    return MappingProxyType({leaf: keys[0] for leaf, keys in by_leaf.items() if len(keys) == 1})


def canonical_key(name: str, source: str) -> str:
    """Dotted key for `name`, or a ConfigError naming the closest valid key."""
    leaves, sections = set(leaf_keys()), set(section_keys())
    if name in leaves:
        return name
    if name in sections and f"{name}.enabled" in leaves:
        return f"{name}.enabled"
    if name in _SYNONYMS:
        return _SYNONYMS[name]
    aliases = _aliases()
    if name in aliases:
        return aliases[name]
    known = sorted(leaves | set(aliases))
    close = difflib.get_close_matches(name[:100], known, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else "run `meshkit config show` to list the keys"
    raise ConfigError(f"unknown config key {brief(name)} ({source}): {hint}")


def flatten(values: Mapping[str, Any], source: str, prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> {dotted key: value}; sections recurse, leaves keep their value as is."""
    sections = set(section_keys())
    flat: dict[str, Any] = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and key in sections:
            flat.update(flatten(value, source, key + "."))
            continue
        if key in sections and isinstance(value, BaseModel):
            flat.update(flatten(explicit_values(value), source, key + "."))
            continue
        flat[canonical_key(key, source)] = value
    return flat


def explicit_values(model: BaseModel) -> dict[str, Any]:
    """The fields a user set explicitly on a config object (recursively), as a nested dict."""
    out: dict[str, Any] = {}
    for name in model.model_fields_set:
        value = getattr(model, name)
        out[name] = explicit_values(value) if isinstance(value, BaseModel) else value
    return out


def _from_text(value: str) -> Any:
    """Strings from the environment or the command line; pydantic coerces the rest ("2" -> 2)."""
    return None if value.strip().lower() in ("none", "null", "~") else value


def default_config_path(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME", str(Path.home())), ".config")
    return Path(base) / "meshkit" / "config.yaml"


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"config file '{file}' does not exist: create it with `meshkit config` or fix the path")
    try:
        data = load_yaml(file.read_text())
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"config file '{file}' is not valid YAML: {first[:200]}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file '{file}' is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{file}' must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def env_values(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """`MESHKIT_*` variables -> ({key: value}, {key: source label})."""
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV or name.startswith(LAUNCHER_ENV_PREFIX):
            continue
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        key = canonical_key(dotted, f"environment variable {name}")
        values[key], labels[key] = _from_text(raw), f"env {name}"
    return values, labels


def standard_env_values(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Variables other tools define that set a meshkit key: `OMP_NUM_THREADS` is the thread count per rank.

    They rank just below `MESHKIT_*` (which names meshkit's key outright). A value a launcher chose because the
    user set none is not the user's, and stays the default.
    """
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if not raw or env.get(ENV_LAUNCHER_THREADS) == raw:
        return {}, {}
    first = raw.split(",")[0].strip()  # OpenMP allows a list, one count per nesting level: the outer one is ours
    if not first.isdigit() or int(first) < 1:
        raise ConfigError(
            f"environment variable OMP_NUM_THREADS={brief(raw)} is not a thread count: set a whole number >= 1, "
            "or unset it for each rank's share of the cores"
        )
    return {"threads_per_process": int(first)}, {"threads_per_process": "env OMP_NUM_THREADS"}


def parse_assignments(items: list[str], source: str = "argument") -> dict[str, Any]:
    """`["tp=2", "compile.mode=max-autotune"]` -> {"parallel.tp": "2", ...} (values stay text)."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{source} '{item}' is not KEY=VALUE (e.g. tp=2 or compile.mode=max-autotune)")
        out[canonical_key(name.strip(), f"{source} '{item}'")] = _from_text(raw.strip())
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys as a tree: {"parallel.tp": 2} -> {"parallel": {"tp": 2}}."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _validation_message(err: ValidationError, sources: Mapping[str, str], merged: Mapping[str, Any]) -> str:
    first = err.errors()[0]
    parts = [str(part) for part in first["loc"] if not isinstance(part, int)]
    reason = first["msg"].removeprefix("Value error, ")
    # pydantic appends the type it tried for a union field ('train.micro_batch_size.int'): name the key as set
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in merged:
            return f"invalid value {brief(merged[key])} for '{key}' ({sources.get(key, 'default')}): {reason}"
    key = ".".join(parts)
    involved = sorted({sources[k] for k in merged if k.startswith(key + ".") and sources[k] != "default"})
    where = f" (set by {', '.join(involved)})" if involved else ""
    return f"invalid '{key or 'config'}'{where}: {reason}"


def launch_flags_from_env(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The launcher's flags as passed to the workers through the environment."""
    raw = env.get(ENV_LAUNCH_FLAGS)
    if not raw:
        return {}, {}
    try:
        data = json.loads(raw)
        values, labels = dict(data["values"]), {str(k): str(v) for k, v in dict(data["labels"]).items()}
    except (ValueError, TypeError, KeyError):
        raise ConfigError(
            f"environment variable {ENV_LAUNCH_FLAGS}={brief(raw)} is not what `meshkit launch` writes for its workers "
            "(JSON with 'values' and 'labels'): unset it"
        ) from None
    return values, labels


def launch_flags_to_env(values: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    return json.dumps({"values": dict(values), "labels": dict(labels)})


def resolve(
    code: Mapping[str, Any] | None = None,
    *,
    flags: Mapping[str, Any] | None = None,
    flag_labels: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    file: str | os.PathLike[str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    file_labels: Mapping[str, str] | None = None,
    cluster: tuple[Mapping[str, Any], Mapping[str, str]] | None = None,
) -> ResolvedConfig:
    """Merge the sources into a validated `RunConfig` (see the module docstring for the order).

    `file` defaults to `$MESHKIT_CONFIG_FILE`, then `~/.config/meshkit/config.yaml` when it exists. `flags`
    default to those the launcher passed to this worker. `code` may nest sections or use leaf names.
    `file_values` replaces reading `file` (a recipe that translated its own file format), each key labelled
    by `file_labels` (default: the file). `cluster`: the launch settings a scheduler's variables give
    (`meshkit.launching.cluster`, read by the launcher only), with their labels: above the file, below `MESHKIT_*`.
    """
    env = os.environ if env is None else env
    if flags is None:
        flags, flag_labels = launch_flags_from_env(env)
    flag_values = {canonical_key(k, "launch flag"): v for k, v in flags.items()}
    flag_labels = {canonical_key(k, "launch flag"): v for k, v in (flag_labels or {}).items()}

    sources = {key: "default" for key in leaf_keys()}
    merged: dict[str, Any] = {}

    def apply(values: Mapping[str, Any], label_of: Any) -> None:
        for key, value in values.items():
            merged[key] = value
            sources[key] = label_of(key)

    path = file if file is not None else env.get(ENV_CONFIG_FILE)
    if path is None and default_config_path(env).is_file():
        path = default_config_path(env)
    if file_values is not None:
        labels = file_labels or {}
        apply(flatten(file_values, f"file {path}"), lambda k: labels.get(k, f"file {path}"))
    elif path is not None and (foreign := foreign_config(path)) is not None:  # an Accelerate or DeepSpeed file
        apply(foreign.values, lambda k: f"file {path} ({foreign.origins[k]})")
        # (said once: by meshkit's launcher, whose workers carry its flags, else by rank 0)
        if foreign.skipped and ENV_LAUNCH_FLAGS not in env and env.get("RANK", "0") == "0":
            names = ", ".join(origin for origin, _ in foreign.skipped)
            warnings.warn(
                f"config file {path}: not imported: {names} (`meshkit config import {path}` says why)", stacklevel=2
            )
    elif path is not None:
        apply(flatten(read_config_file(path), f"file {path}"), lambda _k: f"file {path}")
    if cluster is not None:
        apply(cluster[0], lambda k: cluster[1][k])
    for env_vals, env_labels in (standard_env_values(env), env_values(env)):
        apply(env_vals, env_labels.__getitem__)
    apply(
        {k: _from_text(v) if isinstance(v, str) else v for k, v in flag_values.items()},
        lambda k: flag_labels.get(k, f"flag {k}"),
    )
    code_values = flatten(code or {}, "code argument")
    conflicts = tuple(
        Conflict(key, value, merged[key], sources[key])
        for key, value in code_values.items()
        if key in flag_values and str(merged[key]).lower() != str(value).lower()
    )
    apply(code_values, lambda _k: "code")

    try:
        config = RunConfig.model_validate(nest(merged))
    except ValidationError as err:
        raise ConfigError(_validation_message(err, sources, merged)) from None
    resolved = ResolvedConfig(config=config, sources=sources, conflicts=conflicts)
    for key in leaf_keys():  # e.g. zero_stage=3 makes dp_shard "the rest": say so instead of "default"
        if sources[key] == "default" and resolved.value(key) != _DEFAULTS.value(key):
            sources[key] = "derived from other settings"
    return resolved
