"""`meshkit plan --explain` for a transformers config.json: how tensor parallel would split the model, layer by
layer, and where each decision comes from (the config's declared plan, the traced forward, or layer names)."""

from __future__ import annotations

import re
from pathlib import Path

from rich.console import Console


def tensor_parallel_lines(config_json: Path) -> list[str]:
    """One line per distinct layer (block index shown as *): its split and its source; [] without transformers."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return []
    from meshkit.config.schema import TensorParallelConfig
    from meshkit.models.layer_roles import layer_roles
    from meshkit.models.structure import describe
    from meshkit.parallel.tensor.auto import tensor_plan

    try:
        config = AutoConfig.from_pretrained(config_json.parent if config_json.name == "config.json" else config_json)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 - a config transformers cannot build a model from: say so, go on
        return [f"(not shown: transformers builds no causal LM from {config_json.name}: {str(error).splitlines()[0]})"]
    structure = describe(model)
    roles = layer_roles(model, structure)
    planned = tensor_plan(model, TensorParallelConfig(), roles)
    sources = {name: role.source for name, role in roles.layers.items()} | dict.fromkeys(planned.by_name, "names")
    shown: dict[str, str] = {}
    for name, kind in planned.kinds.items():
        source = sources.get(name, "outside attention/MLP")
        key = re.sub(r"\.\d+\.", ".*.", name)
        shown.setdefault(key, f"{kind:<18}{'by name (the traced forward failed)' if source == 'names' else source}")
    lines = [f"{key:<48}{text}" for key, text in shown.items()]
    lines += [f"{path}: kept whole ({why})" for path, why in list(roles.whole_regions.items())[:4]]
    return lines


def print_tensor_parallel(config_json: Path) -> None:
    lines = tensor_parallel_lines(config_json)
    if lines:
        console = Console()
        console.print("tensor parallel (layer, split, decided by):", highlight=False)
        for line in lines:
            console.print(f"  {line}", highlight=False, markup=False)
