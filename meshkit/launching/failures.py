"""The launcher's one-line account of a failed job: which rank failed first, and how.

torch's agent reports every worker of the last attempt, stamped with whole seconds, including the ones it
stopped itself (SIGTERM) after the first failure. The first failure is the one that exited first by the
supervisor's sub-second clock; without that clock, the one that recorded its error first (error-file
time), then those that died by a signal the launcher did not send.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from meshkit.core.errors import one_line
from meshkit.launching.memory_kills import oom_kill_count, sigkill_hint

# What the agent sends the others after a failure (its SIGKILL comes only 30 s later, and the supervisor's
# own kills are known by pid): a tie between exits seen in one poll goes to the rank that did not get it.
_AGENT_STOP = {signal.SIGTERM.value}
# A SIGKILLed process shows as exited only once the kernel has torn down its memory (for a rank holding torch,
# up to a few hundred ms on a loaded host), while its peers see its sockets close at once and may report
# their error first: its death counts as this much earlier than it was seen.
KILL_TEARDOWN_S = 0.5


class ExitClock(Protocol):
    """When each worker's exit was seen, by pid (`WorkerSupervisor`, or the Ray driver's record)."""

    @property
    def killed(self) -> Collection[int]:  # pids the launcher itself killed after the grace
        ...

    def refresh(self) -> None: ...

    def exit_time(self, pid: int) -> float | None: ...


def _recorded(failure: ProcessFailure) -> bool:
    return bool(failure.error_file) and os.path.isfile(failure.error_file)


def root_cause(
    failures: Mapping[int, ProcessFailure], supervisor: ExitClock | None = None
) -> tuple[int, ProcessFailure]:
    """(global rank, failure) of the rank that failed first."""
    if supervisor is not None:
        supervisor.refresh()
    timed = supervisor is not None and any(supervisor.exit_time(f.pid) is not None for f in failures.values())

    def order(item: tuple[int, ProcessFailure]) -> tuple[float, int, int, float, int]:
        rank, failure = item
        stopped = int(-failure.exitcode in _AGENT_STOP)  # most likely the agent's own stop (ties only)
        # In a tie, a death by a signal nobody in the job sent (SIGKILL, SIGSEGV) comes before an error, which
        # may be its consequence (a peer's "connection closed").
        consequence = int(not (failure.exitcode < 0 and not stopped))
        recorded = os.stat(failure.error_file).st_mtime_ns / 1e9 if _recorded(failure) else float("inf")
        seen = supervisor.exit_time(failure.pid) if supervisor is not None else None
        if seen is not None and supervisor is not None and failure.pid not in supervisor.killed:
            if failure.exitcode == -signal.SIGKILL.value:
                seen -= KILL_TEARDOWN_S
            return seen, stopped, consequence, recorded, rank  # exits seen in one poll tie on time
        if timed:  # the supervisor saw other exits but not this one: it ended after them
            return float("inf"), stopped, consequence, recorded, rank
        if recorded != float("inf"):
            return recorded, 0, 0, recorded, rank
        return failure.timestamp + 1.0, stopped, consequence, recorded, rank

    return min(failures.items(), key=order)


def describe_failure(rank: int, failure: ProcessFailure) -> str:
    """'rank 1 (local rank 1, exit code 1): ValueError: boom' (the rank's full traceback is in its output).

    A rank that recorded an exception is described by it even if the agent's SIGTERM ended it before it
    could exit by itself.
    """
    if not _recorded(failure):
        if failure.exitcode < 0:
            return f"rank {rank} (local rank {failure.local_rank}) was killed by signal {failure.signal_name()}"
        return f"rank {rank} (local rank {failure.local_rank}, exit code {failure.exitcode}): it recorded no error"
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"stopped by {failure.signal_name()}"
    return f"rank {rank} (local rank {failure.local_rank}, {how}): {one_line(str(message))}"


def failure_report(
    failures: Mapping[int, ProcessFailure],
    max_restarts: int,
    supervisor: ExitClock | None = None,
    describe: Callable[[int, ProcessFailure], str] = describe_failure,
    oom_kills_at_start: int | None = None,
) -> tuple[str, int]:
    """The line the launcher prints, and its exit code (the first failure's, at least 1). A first failure by a
    SIGKILL the launcher did not send says whether the out-of-memory killer struck meanwhile
    (`oom_kills_at_start`: the cgroup's count when the job started)."""
    rank, first = root_cause(failures, supervisor)
    hint = ""
    ours = supervisor is not None and first.pid in supervisor.killed
    if first.exitcode == -signal.SIGKILL.value and not _recorded(first) and not ours:
        hint = sigkill_hint(oom_kills_at_start, oom_kill_count())
    # Ranks stopped by the agent after the first failure end by signal; only real failures are listed.
    others = sorted(r for r, f in failures.items() if r != rank and (f.exitcode > 0 or _recorded(f)))
    also = f"; also failed: rank {', '.join(map(str, others))}" if others else ""
    restarts = f"; restarts used up ({max_restarts} of {max_restarts})" if max_restarts else ""
    return f"{describe(rank, first)}{hint}{also}{restarts}", first.exitcode if first.exitcode > 0 else 1
