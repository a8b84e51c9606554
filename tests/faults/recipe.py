"""A tiny `meshkit train` job on two ranks for the fault tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def tiny_recipe(tmp_path: Path, **checkpoint: Any) -> Path:
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "launch": {"nproc_per_node": 2},
                "logging": {"dir": str(tmp_path / "run")},
                "checkpoint": {"dir": str(tmp_path / "ckpt"), "resume": "auto", **checkpoint},
                "model": {"dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 16},
                "train": {"steps": 4, "micro_batch_size": 2, "seq_len": 16, "warmup_steps": 1, "log_every": 1},
            }
        )
    )
    return config


def summary(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "run" / "summary.json").read_text())
