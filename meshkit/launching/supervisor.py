"""Watching this node's workers from the launcher: when each exited and how, and what to do about it.

torch's agent notices exits by polling and stamps them with whole seconds, so when one rank's death makes
its peers fail a moment later the order is lost; and after a failure it gives the others 30 s to react to
SIGTERM, which a stopped (SIGSTOP) or wedged process never does. This thread reads the workers' states
from /proc every 50 ms and

- records each worker's exit time (sub-second) and status, so the report names the rank that failed first;
- after a worker fails, SIGKILLs the workers of the same attempt still alive `stop_grace_s` later
  (a restart's new workers are never touched);
- on the preemption signal (`begin_shutdown`), passes it to each worker's own process, then stops the
  agent (by signalling the launcher once more) as soon as the workers announce their checkpoint in the
  state directory, a worker dies, or `shutdown_grace_s` is over; a worker that exits with the preemption
  code while the launcher was not signalled (the scheduler signalled only the workers) starts the same.

Linux only (it needs /proc); elsewhere it does nothing and torch's own behaviour applies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshkit.runtime.preemption import ANNOUNCEMENT, LAUNCHER_STATE_ENV, PREEMPTED_EXIT_CODE, TOLERATED_PREFIX

POLL_S = 0.05
FAILED_PREFIX = "failed-"  # what `meshkit.launching.worker` writes (+ its pid) before it exits with an error


@dataclass(frozen=True)
class WorkerExit:
    pid: int
    at: float  # wall-clock time the exit was seen (within POLL_S)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's, as torch may start workers from any)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def exit_status(pid: int) -> tuple[bool, int | None]:
    """(exited, status): a zombie's status is still readable from /proc until torch reaps it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True, None  # gone: reaped already
    if fields[0] != "Z":
        return False, None
    raw = int(fields[-1]) if len(fields) >= 50 else None  # exit_code, in waitpid() form
    if raw is None:
        return True, None
    return True, (-(raw & 0x7F) if raw & 0x7F else (raw >> 8) & 0xFF)


class WorkerSupervisor:
    """Run as a context around the agent; `exits` holds what it saw, by pid."""

    def __init__(self, stop_grace_s: float, preempt_signal: int | None) -> None:
        self.stop_grace_s = stop_grace_s
        self.preempt_signal = preempt_signal
        self.exits: dict[int, WorkerExit] = {}
        self.killed: set[int] = set()  # pids this supervisor SIGKILLed after the grace
        self._signalled = threading.Event()  # the preemption signal arrived: the workers are stopping
        self.stopped_by: int | None = None  # the signal that began the shutdown (the preemption signal, or SIGINT)
        self._announcement: dict[str, Any] | None = None
        self._stop_deadline: float | None = None
        self._agent_stopped = False
        self.state_dir = Path(tempfile.mkdtemp(prefix="meshkit-launch-"))
        self._alive: set[int] = set()
        self._kill_at: float | None = None
        self._condemned: set[int] = set()
        self._stopped: set[int] = set()  # every pid ever condemned: its own exit is a consequence, not a cause
        self._noted_at: dict[int, float] = {}  # workers that noted their own failure, and when it was seen
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="meshkit-worker-supervisor", daemon=True)
        self.enabled = Path(f"/proc/{os.getpid()}/task").is_dir()

    def __enter__(self) -> WorkerSupervisor:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._poll()  # exits seen during the final wait of the agent
        self._announcement = self.preemption_announced()
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def worker_env(self) -> dict[str, str]:
        return {LAUNCHER_STATE_ENV: str(self.state_dir)}

    def preemption_announced(self) -> dict[str, Any] | None:
        """What the workers wrote once their preemption checkpoint was committed (step, checkpoint)."""
        if not self.state_dir.is_dir():
            return self._announcement
        try:
            return json.loads((self.state_dir / ANNOUNCEMENT).read_text())
        except (OSError, ValueError):
            return None

    def begin_shutdown(self, signum: int, grace_s: float) -> bool:
        """The launcher got the preemption signal (or Ctrl-C's SIGINT). The first time: pass the preemption
        signal on to the workers and return True (the agent goes on watching them); afterwards False: the agent
        must stop now."""
        if self._signalled.is_set():
            return False
        self._signalled.set()
        self.stopped_by = signum
        self._stop_deadline = time.monotonic() + grace_s
        for pid in sorted(self._alive):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, self.preempt_signal or signum)
        return True

    def tolerated(self, pid: int) -> bool:
        """The worker declared that the job survives its loss (an asynchronous parameter-server worker)."""
        return (self.state_dir / f"{TOLERATED_PREFIX}{pid}").exists()

    def exit_time(self, pid: int) -> float | None:
        """When the worker failed: when it said so itself, else when its exit was seen."""
        record = self.exits.get(pid)
        times = [t for t in (self._noted_at.get(pid), record.at if record is not None else None) if t is not None]
        return min(times) if times else None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def refresh(self) -> None:
        """Look once more now (the agent may have reaped the last exits since the thread's last look)."""
        if self.enabled:
            self._poll()

    def _poll(self) -> None:
        with self._lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        now = time.time()
        self._alive.update(pid for pid in child_pids(os.getpid()) if pid not in self.exits)
        for pid in self._noted_failures():  # a worker about to exit with an error (it said so itself)
            self._react(pid, 1)
        for pid in sorted(self._alive):
            exited, status = exit_status(pid)
            if not exited:
                continue
            self._alive.discard(pid)
            self.exits[pid] = WorkerExit(pid, now)
            self._react(pid, status)
        if not self._agent_stopped and (self.state_dir / ANNOUNCEMENT).exists():
            self._signalled.set()  # also when only the workers got the signal: stop before any restart
            self._stop_agent()
        deadline = self._stop_deadline
        if self._signalled.is_set() and not self._agent_stopped and deadline and time.monotonic() >= deadline:
            self._stop_agent()
        if self._kill_at is not None and time.monotonic() >= self._kill_at:
            for pid in self._condemned & self._alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    self.killed.add(pid)
            self._kill_at, self._condemned = None, set()

    def _noted_failures(self) -> list[int]:
        found = []
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.state_dir):
                if entry.name.startswith(FAILED_PREFIX) and entry.name[len(FAILED_PREFIX) :].isdigit():
                    pid = int(entry.name[len(FAILED_PREFIX) :])
                    if pid not in self._noted_at:
                        self._noted_at[pid] = time.time()
                        found.append(pid)
        return found

    def _stop_agent(self) -> None:
        """Signal the launcher again: its handler raises torch's SignalException, and the agent stops every
        worker (they have checkpointed, or had their grace) instead of restarting them."""
        self._agent_stopped = True
        os.kill(os.getpid(), self.preempt_signal or signal.SIGTERM)

    def _react(self, pid: int, status: int | None) -> None:
        if status is None or pid in self._stopped:
            return  # unknown (reaped first), or one this supervisor or the agent was already stopping
        if self._signalled.is_set():
            if status != 0 and not self._agent_stopped:
                self._stop_agent()
            return
        if status == PREEMPTED_EXIT_CODE and self.preempt_signal is not None:
            self.begin_shutdown(self.preempt_signal, 0.0)  # only the workers were signalled
            return
        if status == 0 or self._kill_at is not None or self.tolerated(pid):
            return  # (a tolerated worker's loss stops nobody: the agent goes on without it)
        # A failure: the others of this attempt get the grace to exit after the agent's SIGTERM.
        self._condemned = self._alive - {pid}
        self._stopped |= self._condemned | {pid}  # their exits (and this one's, if noted early) follow from it
        self._kill_at = time.monotonic() + self.stop_grace_s
