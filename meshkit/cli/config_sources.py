"""Where `meshkit`'s commands take config values from: launch flags and `key=value` assignments as labelled
overrides, and the config `meshkit config show` resolves (a meshkit or fine-tune YAML given as `train` takes it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meshkit.config.resolve import ConfigError, ResolvedConfig, parse_assignments, resolve
from meshkit.launching.cluster import cluster_settings


def collect_flags(named: dict[str, tuple[str, Any]], assignments: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Launch flags as config overrides, each labelled with the flag that set it."""
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for key, (flag, value) in named.items():
        if value is not None:
            values[key], labels[key] = value, f"flag {flag}"
    from_set = parse_assignments(assignments, source="--set")
    values.update(from_set)
    labels.update({key: f"flag --set {key}" for key in from_set})
    return values, labels


def shown_config(config: str | None, assignments: list[str], config_file: Path | None) -> ResolvedConfig:
    """The config `config show` prints: `config` (a file, or a first `key=value` when no file is given) or
    `--config-file`, with the assignments; a fine-tune config resolved as `meshkit finetune` resolves it."""
    if config is not None and "=" in config and not Path(config).is_file():
        assignments = [config, *assignments]  # (only overrides given: `meshkit config show tp=2`)
        config = None
    if config is not None and config_file is not None:
        raise ConfigError(f"two configs given ({config} and --config-file {config_file}): give one")
    path = Path(config) if config is not None else config_file
    if path is not None and not path.is_file():
        raise ConfigError(f"config {path} does not exist")
    if path is not None and _is_finetune_config(path):
        from meshkit.recipes.finetune_config import resolve_finetune

        return resolve_finetune(path, assignments, cluster=True).resolved
    flags, labels = collect_flags({}, assignments)
    return resolve(flags=flags, flag_labels=labels, file=path, cluster=cluster_settings(os.environ))


def _is_finetune_config(path: Path) -> bool:
    """(a file that is no YAML at all gets the config resolver's own error)"""
    from meshkit.cli.config_run import is_finetune_config
    from meshkit.planning.estimate import EstimateError

    try:
        return is_finetune_config(path)
    except EstimateError:
        return False
