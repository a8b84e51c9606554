"""Trackers fed by `engine.log()` on the main process: JSON lines always, TensorBoard when installed."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from meshkit.errors import MeshkitError


class TrackerError(MeshkitError):
    """A tracker that cannot run here; the message says what to install."""


class Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Numbers and one-element tensors as floats; other values are left out."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[name] = float(value.item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class JsonlTracker:
    """One JSON object per `log` call in `<dir>/metrics.jsonl`, flushed at once (safe to tail)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file: TextIO | None = None  # opened at the first log: a run that logs nothing writes nothing

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker:
    """Scalars for TensorBoard under `<dir>/tensorboard`."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def check_trackers(names: tuple[str, ...]) -> None:
    """Fail before training if a requested tracker's package is missing."""
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        raise TrackerError(
            "tracker 'tensorboard' needs the tensorboard package: pip install 'meshkit[tensorboard]', "
            "or set logging.trackers=jsonl"
        )


def make_trackers(names: tuple[str, ...], run_dir: Path) -> list[Tracker]:
    check_trackers(names)
    kinds = {"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker}
    return [kinds[name](run_dir) for name in dict.fromkeys(names)]
