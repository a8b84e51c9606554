"""Module names as transformers 4 wrote them. transformers 5 renamed some models' modules (a multimodal model's
`language_model.model.layers` became `model.language_model.layers`) and keeps the renames, as regular expressions
over checkpoint keys, to load old checkpoints (`conversion_mapping`). A `lora_target_modules` regex written for the
old names (Axolotl's Voxtral example) matches the model's modules through those same renames, read backwards."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

_PREFIX = re.compile(r"\^?([\w.\\]+)")  # a rename of a plain prefix ('^language_model.model', escaped or not)


def _prefix_renames(model: nn.Module) -> list[tuple[str, str]]:
    """(old prefix, new prefix) of each plain-prefix rename transformers applies to `model`'s checkpoints."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping
    except ImportError:  # (transformers 4: the names are the old ones)
        return []
    transformers_model: Any = model
    renames = []
    for rule in get_model_conversion_mapping(transformers_model) or []:
        if not isinstance(rule, WeightRenaming):
            continue
        for source in rule.source_patterns:
            old = _PREFIX.fullmatch(source)
            if old and source.startswith("^") and len(rule.target_patterns) == 1:
                renames.append((old.group(1).replace("\\", ""), rule.target_patterns[0]))
    return renames


def old_names(name: str, renames: list[tuple[str, str]], depth: int = 3) -> set[str]:
    """The names `name` may have had before the renames (each applied backwards, up to `depth` in a row)."""
    found: set[str] = set()
    frontier = {name}
    for _ in range(depth):
        frontier = {
            old + current[len(new) :]
            for current in frontier
            for old, new in renames
            if current == new or current.startswith(new + ".")
        } - found
        found |= frontier
    return found


def targets_by_old_names(model: nn.Module, pattern: str) -> list[str] | None:
    """The modules a `lora_target_modules` regex names under their transformers-4 names, when it matches none of
    their names now (None: it matches as written, or matches nothing either way)."""
    names = [name for name, _ in model.named_modules() if name]
    if any(re.fullmatch(pattern, name) for name in names):
        return None
    renames = _prefix_renames(model)
    matched = [name for name in names if any(re.fullmatch(pattern, old) for old in old_names(name, renames))]
    return matched or None
