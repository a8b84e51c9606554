"""`meshkit config`: a short questionnaire that writes the YAML config file (like `accelerate config`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

Ask = Callable[[str, Any, list[str] | None], str]
"""ask(question, default, choices) -> the answer as text."""


def ask_config(ask: Ask) -> dict[str, Any]:
    """Ask the questions that most runs need; returns the nested config to write."""
    launch: dict[str, Any] = {"nproc_per_node": int(ask("Processes (ranks) per node", 1, None))}
    nnodes = int(ask("Number of nodes (machines)", 1, None))
    launch["nnodes"] = nnodes
    if nnodes > 1:
        launch["node_rank"] = int(ask("Rank of this node (0 hosts the rendezvous)", 0, None))
        launch["master_addr"] = ask("Address of node 0", "127.0.0.1", None)
        launch["master_port"] = int(ask("Rendezvous port on node 0", 29500, None))
    launch["max_restarts"] = int(ask("Restarts after a worker failure", 0, None))
    parallel = {
        "tp": int(ask("Tensor-parallel size (1 = off)", 1, None)),
        "pp": int(ask("Pipeline-parallel stages (1 = off)", 1, None)),
    }
    config: dict[str, Any] = {
        "launch": launch,
        "parallel": parallel,
        "precision": ask("Mixed precision", "no", ["no", "bf16", "fp16"]),
        "grad_accum_steps": int(ask("Gradient accumulation steps", 1, None)),
    }
    if ask("Compile the model with torch.compile? (yes/no)", "no", ["yes", "no"]) == "yes":
        config["compile"] = {"enabled": True}
    return config


def write_config(config: dict[str, Any], path: Path) -> Path:
    """Write atomically: a half-written file never replaces a good one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("# meshkit config, written by `meshkit config`\n" + yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp, path)
    return path
