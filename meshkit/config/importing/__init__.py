"""`meshkit config import FILE`: an Accelerate config (the YAML `accelerate config` writes) or a DeepSpeed config
(JSON, `//` comments allowed) as a meshkit YAML, each key with a comment naming where it came from. Every key
meshkit does not take is listed with the reason — none is dropped silently. `"auto"` values are left to the run
(meshkit's setting applies, as DeepSpeed fills them from the trainer). DeepSpeed's `train_batch_size` is split
into the per-rank micro-batch when the world size is known (`--world`, or the Accelerate config's
`num_processes`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from meshkit.config.importing.accelerate import read_accelerate
from meshkit.config.importing.deepspeed import read_deepspeed
from meshkit.config.importing.result import Imported, ImportingError

__all__ = ["Imported", "ImportingError", "foreign_config", "import_config", "to_yaml"]


def _strip_comments(text: str) -> str:
    """JSON with `//` line comments (outside strings), as config examples often have."""
    lines = []
    for line in text.splitlines():
        quoted = False
        for i, char in enumerate(line):
            if char == '"' and (i == 0 or line[i - 1] != "\\"):
                quoted = not quoted
            elif not quoted and line.startswith("//", i):
                line = line[:i]
                break
        lines.append(line)
    return "\n".join(lines)


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ImportingError(f"{path} does not exist")
    text = path.read_text()
    try:
        data = json.loads(_strip_comments(text)) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise ImportingError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}") from None
    if not isinstance(data, dict):
        raise ImportingError(f"{path} holds no mapping of settings")
    return data


def _kind(data: dict[str, Any]) -> str | None:
    if {"distributed_type", "compute_environment"} & set(data):
        return "accelerate"
    if {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu"} & set(data) or any(
        isinstance(data.get(name), dict) and "enabled" in data[name] for name in ("bf16", "fp16")
    ):
        return "deepspeed"
    return None


def import_config(path: str | Path, world: int | None = None) -> Imported:
    """The meshkit settings of an Accelerate or DeepSpeed config file."""
    path = Path(path)
    data = _read(path)
    out = Imported()

    def deepspeed_file(name: str, processes: int | None) -> None:
        ds_path = (path.parent / name) if not Path(name).is_absolute() else Path(name)
        read_deepspeed(_read(ds_path), out, prefix=f"{ds_path.name}: ", world=world or processes)

    kind = _kind(data)
    if kind == "accelerate":
        read_accelerate(data, out, deepspeed_file)
    elif kind == "deepspeed":
        read_deepspeed(data, out, world=world)
    else:
        raise ImportingError(
            f"{path} is neither an Accelerate config (distributed_type, num_processes, ...) nor a DeepSpeed config "
            "(zero_optimization, train_batch_size, ...)"
        )
    return out


def foreign_config(path: str | os.PathLike[str]) -> Imported | None:
    """The file's meshkit settings when it is an Accelerate or DeepSpeed config (a `--config-file` may name one:
    it is converted on the fly); None for a meshkit YAML."""
    path = Path(path).expanduser()
    if not path.is_file():
        return None
    try:
        data = _read(path)
    except (ImportingError, UnicodeDecodeError):
        return None  # the meshkit reader reports what is wrong with it
    return import_config(path) if _kind(data) else None


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def to_yaml(imported: Imported, source: Path) -> str:
    """The settings as meshkit YAML, grouped by section, a comment per key naming its origin; then what was not
    imported and the notes, as comments."""
    lines = [f"# meshkit config imported from {source}"]
    sections: dict[str, list[str]] = {}
    for key in sorted(imported.values, key=lambda k: (k.count("."), k)):
        section, _, leaf = key.rpartition(".")
        sections.setdefault(section, []).append(leaf)
    for leaf in sections.pop("", []):
        lines.append(f"{leaf}: {_scalar(imported.values[leaf])}  # {imported.origins[leaf]}")
    for section in sorted(sections):
        lines.append(f"{section}:")
        for leaf in sections[section]:
            key = f"{section}.{leaf}"
            lines.append(f"  {leaf}: {_scalar(imported.values[key])}  # {imported.origins[key]}")
    if imported.skipped:
        lines.append("# not imported:")
        lines += [f"#   {origin}: {why}" for origin, why in imported.skipped]
    lines += [f"# note: {note}" for note in imported.notes]
    return "\n".join(lines) + "\n"
