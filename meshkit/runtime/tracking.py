"""Trackers fed by `engine.log()` on the reporting rank: JSON lines always; TensorBoard and Weights & Biases
when installed (`meshkit[tensorboard]`, `meshkit[wandb]`)."""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from meshkit.core.errors import MeshkitError


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

    def __init__(self, run_dir: Path, hparams: Mapping[str, Any]) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file: TextIO | None = None  # opened at the first log: a run that logs nothing writes nothing
        if hparams:  # `init_trackers(config=...)`: the user's run configuration, beside the metrics
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "hparams.json").write_text(json.dumps(dict(hparams), indent=2, default=str) + "\n")

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

    def __init__(self, run_dir: Path, hparams: Mapping[str, Any], writer_kwargs: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(**{"log_dir": str(run_dir / "tensorboard"), **writer_kwargs})
        values = {k: v for k, v in hparams.items() if isinstance(v, (int, float, str, bool))}
        if values:  # as Accelerate's tracker does: the user's run configuration as hyperparameters
            self.writer.add_hparams(values, metric_dict={}, run_name=".")

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

    def __init__(
        self, run_dir: Path, run_config: Mapping[str, Any], project: str | None, init_kwargs: Mapping[str, Any]
    ) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_credentials() else "offline")
        if mode == "offline" and "WANDB_MODE" not in os.environ:
            later = f"`wandb sync {run_dir}/wandb/offline-run-*`"
            print(f"meshkit: wandb runs offline (no credentials); upload it later with {later}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        options: dict[str, Any] = {
            "dir": str(run_dir),
            "mode": mode,
            "project": project or os.environ.get("WANDB_PROJECT", "meshkit"),
            "name": os.environ.get("WANDB_NAME", run_dir.name),
            "config": dict(run_config),
        }
        self.run = wandb.init(**{**options, **init_kwargs})  # `init_trackers(init_kwargs={"wandb": {...}})` wins

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


@dataclass(frozen=True)
class TrackerStart:
    """What `init_trackers` adds: the project name, the user's run configuration, per-tracker keyword arguments."""

    project: str | None = None
    hparams: Mapping[str, Any] = field(default_factory=dict)
    init_kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def make_trackers(
    names: tuple[str, ...], run_dir: Path, run_config: Mapping[str, Any], start: TrackerStart
) -> list[Tracker]:
    """The trackers named, in order, once each; the resolved settings and the user's configuration go to those
    that record a configuration."""
    check_trackers(names)
    made: list[Tracker] = []
    for name in dict.fromkeys(names):
        kwargs = dict(start.init_kwargs.get(name, {}))
        if name == "wandb":
            made.append(WandbTracker(run_dir, {**run_config, **start.hparams}, start.project, kwargs))
        elif name == "tensorboard":
            made.append(TensorBoardTracker(run_dir, start.hparams, kwargs))
        else:
            made.append(JsonlTracker(run_dir, start.hparams))
    return made


class TrackerSet:
    """The run's trackers on the reporting rank, made when first needed: by `init_trackers()` or by the first
    `log()` (so a run may name its project first, as with Accelerate); closed once, for good."""

    def __init__(self, names: tuple[str, ...], run_dir: Path, run_config: Mapping[str, Any], here: bool) -> None:
        self.names, self._run_dir, self._run_config, self._here = names, run_dir, run_config, here
        self._made: list[Tracker] | None = None

    def start(self, start: TrackerStart) -> list[Tracker]:
        if self._made is not None:
            raise TrackerError(
                "init_trackers() comes before the first engine.log() or get_tracker() (the trackers are already "
                "running): call it once, right after creating the engine"
            )
        self._made = made = make_trackers(self.names, self._run_dir, self._run_config, start) if self._here else []
        return made

    @property
    def started(self) -> bool:
        return self._made is not None

    @property
    def running(self) -> list[Tracker]:
        made = self._made
        if made is None:
            made = self.start(TrackerStart())
        return made

    def close(self) -> None:
        for tracker in self._made or []:
            tracker.close()
        self._made = []
