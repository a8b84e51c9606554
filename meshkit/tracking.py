"""Trackers fed by `engine.log()` on the reporting rank: JSON lines always; TensorBoard and Weights & Biases
when installed (`meshkit[tensorboard]`, `meshkit[wandb]`)."""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
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

    name = "jsonl"

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

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_credentials() -> bool:
    """An API key in the environment, or an api.wandb.ai entry in ~/.netrc (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    """A Weights & Biases run under `<dir>/wandb`, with the resolved run config. `WANDB_MODE` decides where it
    goes; without it, online when credentials exist, else offline (`wandb sync <dir>/wandb/offline-run-*` later)."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_config: Mapping[str, Any]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_credentials() else "offline")
        if mode == "offline" and "WANDB_MODE" not in os.environ:
            later = f"`wandb sync {run_dir}/wandb/offline-run-*`"
            print(f"meshkit: wandb runs offline (no credentials); upload it later with {later}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            dir=str(run_dir),
            mode=mode,  # type: ignore[arg-type]
            project=os.environ.get("WANDB_PROJECT", "meshkit"),
            name=os.environ.get("WANDB_NAME", run_dir.name),
            config=dict(run_config),
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_trackers(names: tuple[str, ...]) -> None:
    """Fail before training if a requested tracker's package is missing."""
    for name in names:
        package = _PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise TrackerError(
                f"tracker '{name}' needs the {package} package: pip install 'meshkit[{name}]', "
                "or set logging.trackers=jsonl"
            )


def make_trackers(names: tuple[str, ...], run_dir: Path, run_config: Mapping[str, Any] | None = None) -> list[Tracker]:
    """The trackers named, in order, once each; `run_config` (the resolved settings) goes to those that record it."""
    check_trackers(names)
    made: list[Tracker] = []
    for name in dict.fromkeys(names):
        if name == "wandb":
            made.append(WandbTracker(run_dir, run_config or {}))
        else:
            made.append({"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker}[name](run_dir))
    return made
