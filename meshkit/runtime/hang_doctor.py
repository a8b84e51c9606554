"""The hang doctor: when a collective stalls, say which rank is stuck, in which collective, at which step.

Each rank marks the engine calls that talk to the other ranks (`prepare`, `train_step`, `backward`, `reduce`,
`gather`, barriers) as phases; checkpoint saves and loads are not marked, as their file writes may rightly
outlast the collective timeout. A background thread publishes this rank's phase, step and time to the
job's key-value store once a second and watches its own phase: once a phase outlasts the collective timeout
it reads every rank's heartbeat and writes a diagnosis, e.g.

    rank 0 waited 5.0 s in train_step at step 2 (timeout 5 s); not there: rank 1 (outside meshkit calls
    since train_step ended at step 2, 5.0 s ago)

When the collective then fails with its timeout error (gloo raises it in the caller), the error becomes a
`HangError` carrying the diagnosis, which the launcher prints for the failing rank. If the process is still
stuck `grace_s` later (a backend that aborts instead of raising), the thread records the diagnosis for the
launcher and ends the process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch.distributed as dist

from meshkit.core.errors import MeshkitError

OUTSIDE = "outside meshkit calls"


class HangError(MeshkitError):
    """A collective outlasted its timeout; the message names the ranks that never reached it."""


@dataclass
class Heartbeat:
    rank: int
    phase: str | None  # None: between meshkit calls (the user's own code)
    step: int
    since: float  # wall time the phase began (or the last one ended)
    last: str | None  # the previous phase
    timeout_s: float
    published: float = 0.0

    def where(self, now: float) -> str:
        if self.phase is not None:
            return f"in {self.phase} at step {self.step} for {now - self.since:.1f} s"
        after = f" since {self.last} ended at step {self.step}," if self.last else " since it started,"
        return f"{OUTSIDE}{after} {now - self.since:.1f} s ago"


def connect_store(world_size: int) -> dist.Store | None:
    """A client of the job's store (the launcher's MASTER_ADDR:MASTER_PORT); None when there is none."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size < 2 or not addr or not port:
        return None
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=10))
    except (RuntimeError, ValueError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"meshkit/heartbeat/{attempt}", store)


class Stepping(Protocol):
    """What a watched method's object offers: the optimizer steps taken (named in a diagnosis)."""

    @property
    def step(self) -> int: ...


Owner = TypeVar("Owner", bound=Stepping)
Params = ParamSpec("Params")
Result = TypeVar("Result")


class HangDoctor:
    """Phases of this rank, heartbeats to the store, and the diagnosis on a stall."""

    def __init__(
        self, rank: int, world_size: int, timeout_s: float, *, interval_s: float = 1.0, grace_s: float = 5.0
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.interval_s, self.grace_s = timeout_s, interval_s, grace_s
        self.state = Heartbeat(rank, None, 0, time.time(), None, timeout_s)
        self.store = connect_store(world_size)
        self.report: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if self.store is not None:
            self._thread = threading.Thread(target=self._watch, name="meshkit-hang-doctor", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ main thread
    @contextlib.contextmanager
    def phase(self, name: str, step: Callable[[], int], timeout_s: float | None = None) -> Iterator[None]:
        """Mark a call that waits for other ranks (`step` gives the optimizer step count); a failure after the
        timeout becomes a `HangError`."""
        if self.state.phase is not None:  # nested (e.g. reduce inside train_step): the outer phase counts
            yield
            return
        with self._lock:
            self.state = Heartbeat(self.rank, name, step(), time.time(), self.state.last, timeout_s or self.timeout_s)
            self.report = None
        try:
            yield
        except RuntimeError as err:  # gloo and NCCL report a timed-out collective as a RuntimeError
            waited = time.time() - self.state.since
            if waited >= 0.9 * self.state.timeout_s and _is_timeout(err):
                raise HangError(self.report or self.diagnose()) from err
            raise
        finally:
            with self._lock:
                self.state = Heartbeat(self.rank, None, step(), time.time(), name, self.timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ diagnosis
    def peers(self) -> list[Heartbeat | None]:
        if self.store is None:
            return []
        found: list[Heartbeat | None] = []
        for rank in range(self.world_size):
            key = str(rank)
            try:
                found.append(Heartbeat(**json.loads(self.store.get(key))) if self.store.check([key]) else None)
            except (RuntimeError, ValueError, TypeError):
                found.append(None)
        return found

    def diagnose(self) -> str:
        now, me = time.time(), self.state
        head = (
            f"rank {self.rank} waited {now - me.since:.1f} s in {me.phase} at step {me.step} "
            f"(timeout {me.timeout_s:g} s)"
        )
        peers = self.peers()
        if not peers:
            return head + "; the other ranks' heartbeats are unavailable"
        behind = []
        for rank, beat in enumerate(peers):
            if rank == self.rank:
                continue
            if beat is None or now - beat.published > 3 * self.interval_s + 2:
                seen = "never" if beat is None else f"{now - beat.published:.1f} s ago"
                behind.append(f"rank {rank} (no heartbeat, last {seen}: its process died or froze)")
            elif beat.phase != me.phase or beat.step != me.step:
                behind.append(f"rank {rank} ({beat.where(now)})")
        if not behind:
            return head + "; every rank is in it: the collective itself is stuck (network, or a peer's device)"
        return head + "; not there: " + ", ".join(behind)

    # ------------------------------------------------------------------ background thread
    def _publish(self) -> None:
        with self._lock:
            beat = Heartbeat(**{**asdict(self.state), "published": time.time()})
        with contextlib.suppress(RuntimeError):  # the store may be gone at the end of a job
            assert self.store is not None
            self.store.set(str(self.rank), json.dumps(asdict(beat)))

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._publish()
            state = self.state
            if state.phase is None:
                continue
            waited = time.time() - state.since
            if waited > state.timeout_s and self.report is None:
                self.report = self.diagnose()
                print(f"meshkit hang doctor: {self.report}", file=sys.stderr, flush=True)
            if waited > state.timeout_s + self.grace_s and self.report is not None:
                _record_and_exit(HangError(self.report))


def _is_timeout(err: RuntimeError) -> bool:
    """A backend's timeout (gloo: "Timed out waiting ...", NCCL watchdog: "... timeout") or a broken peer."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text or isinstance(err, getattr(dist, "DistBackendError", ()))


def _record_and_exit(error: HangError) -> None:
    """End a process whose collective never returned, leaving the diagnosis for the launcher."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    with contextlib.suppress(Exception):
        ErrorHandler().record_exception(error)
    os._exit(1)


def watched(
    name: str,
) -> Callable[[Callable[Concatenate[Owner, Params], Result]], Callable[Concatenate[Owner, Params], Result]]:
    """Mark a method as a phase that waits for other ranks: it runs under the object's `hang_doctor` (if it has
    one that is not None), which names the phase and `step` when a peer never arrives. The method keeps its
    signature (an editor and mypy see its real parameters and result)."""

    def wrap(method: Callable[Concatenate[Owner, Params], Result]) -> Callable[Concatenate[Owner, Params], Result]:
        @functools.wraps(method)
        def run(self: Owner, *args: Params.args, **kwargs: Params.kwargs) -> Result:
            doctor = getattr(self, "hang_doctor", None)
            if doctor is None:
                return method(self, *args, **kwargs)
            with doctor.phase(name, lambda: self.step):
                return method(self, *args, **kwargs)

        return run

    return wrap
