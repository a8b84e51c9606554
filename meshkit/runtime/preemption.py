"""Graceful preemption in the workers: on the preemption signal (or Ctrl-C's SIGINT), every rank checkpoints at
the same step and exits with `PREEMPTED_EXIT_CODE` (130 after Ctrl-C outside `meshkit launch`); a second Ctrl-C
stops at once (KeyboardInterrupt).

Schedulers announce the end of a job with a signal and kill it a grace period later (SLURM `--signal`,
Kubernetes SIGTERM then SIGKILL after `terminationGracePeriodSeconds`). The handler only notes the signal.
The watch is armed by the first `engine.save_checkpoint()` call (or up front by
`engine.checkpoints.arm_preemption()`, as the recipes do) — a loop that checkpoints that way can stop at a step
boundary; before that (or in a loop that never checkpoints) the signal keeps its default
action. Once armed, every `save_checkpoint()` call all-reduces one flag (a tiny gloo all-reduce on a group
of its own), so all ranks see the signal at the same call, save there and stop together.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; the launcher exits with it too
LAUNCHER_STATE_ENV = "MESHKIT_LAUNCHER_STATE"  # a directory `meshkit launch` watches
ANNOUNCEMENT = "preempted.json"
TOLERATED_PREFIX = "tolerated-"  # + pid: a worker whose loss the job survives (the launcher goes on without it)
ANNOUNCE_PAUSE_S = 1.0  # time the launcher gets to see the announcement before the workers exit


INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # Ctrl-C, as shells report it


class Preempted(SystemExit):
    """Ends the process once the preemption checkpoint is committed: with PREEMPTED_EXIT_CODE, or 130 after
    Ctrl-C outside `meshkit launch` (under it the launcher reports Ctrl-C's code itself)."""

    def __init__(self, step: int, signal_name: str) -> None:
        launched = bool(os.environ.get(LAUNCHER_STATE_ENV))
        interrupted = signal_name == "SIGINT" and not launched
        super().__init__(INTERRUPTED_EXIT_CODE if interrupted else PREEMPTED_EXIT_CODE)
        self.step = step
        self.signal_name = signal_name


def signal_number(name: str) -> int | None:
    """'SIGTERM' -> 15; 'none' -> None."""
    if name.lower() == "none":
        return None
    return int(getattr(signal, name))


class PreemptionWatch:
    """The signal flag of this rank and the agreement over all ranks."""

    def __init__(self, signal_name: str, world_size: int) -> None:
        self.signal_name = signal_name
        self.signum = signal_number(signal_name)
        self.world_size = world_size
        self._received = threading.Event()
        self._interrupted = False  # Ctrl-C came once: a second one stops at once
        self._armed = False
        self._previous: dict[int, Any] = {}
        self._group: dist.ProcessGroup | None = None

    @property
    def received(self) -> bool:
        """This rank got the signal (the ranks act on it together at the next `agreed()`)."""
        return self._received.is_set()

    def arm(self) -> None:
        """Catch the signal from now on (collective when armed for the first time: all ranks call it)."""
        if self._armed or self.signum is None:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "save_checkpoint() runs outside the main thread: graceful preemption is off (signals reach the "
                "main thread only)",
                stacklevel=3,
            )
            self.signum = None
            return
        if self.world_size > 1 and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # never shared with the checkpoint's background writes
        for signum in dict.fromkeys((self.signum, signal.SIGINT)):  # Ctrl-C stops at a step as the signal does
            self._previous[signum] = signal.signal(signum, self._note)
        self._armed = True

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._interrupted:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (under `meshkit launch`: quietly, 130)
        if not self._received.is_set():
            self.signal_name = signal.Signals(signum).name  # (what the messages name)
        self._interrupted = self._interrupted or signum == signal.SIGINT
        self._received.set()

    def agreed(self) -> bool:
        """True on every rank when any rank got the signal (collective once armed)."""
        if not self._armed:
            return False
        flag = torch.tensor([int(self._received.is_set())], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def disarm(self) -> None:
        """Give the signal its previous handler back (the engine ends)."""
        if self._armed and threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
        self._armed = False


def declare_tolerated_exit() -> None:
    """Tell `meshkit launch` (when it started this worker) that the job goes on if this worker is lost."""
    state_dir = os.environ.get(LAUNCHER_STATE_ENV)
    if state_dir and Path(state_dir).is_dir():
        (Path(state_dir) / f"{TOLERATED_PREFIX}{os.getpid()}").touch()


def announce(state_dir: str | None, step: int, checkpoint: Path, signal_name: str) -> None:
    """Tell `meshkit launch` (when it started this worker) that the preemption checkpoint is committed, and
    give it a moment to stop the agent before this worker's exit could be taken for a failure to restart."""
    if not state_dir or not Path(state_dir).is_dir():
        return
    target = Path(state_dir) / ANNOUNCEMENT
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"step": step, "checkpoint": str(checkpoint), "signal": signal_name}))
    os.replace(tmp, target)
    time.sleep(ANNOUNCE_PAUSE_S)
