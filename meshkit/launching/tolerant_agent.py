"""Going on without a worker whose loss the job survives: asynchronous parameter-server workers.

torch's agent takes any worker's failed exit for the group's failure: its process context stops every other
worker at once. A worker the job can lose (an asynchronous parameter-server worker: the servers notice its
connection close and go on) declares so in the launcher's state directory when it starts
(`meshkit.runtime.preemption.declare_tolerated_exit`). While such a worker is in the group this agent reads the
workers' exits itself: the group is healthy while the others run, succeeded once they have all exited 0 (the
lost ones are listed for the launcher's report), and failed, by torch's own path, as soon as any other worker
fails or every worker that could be lost is. Groups without such a worker are monitored exactly as torch does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher import api as launcher_api


@dataclass(frozen=True)
class LostWorker:
    rank: int
    local_rank: int
    exitcode: int  # negative: the signal that ended it


class TolerantAgent(LocalElasticAgent):
    """torch's agent, which may go on without the workers `tolerated` names (parameter-server workers of an
    asynchronous job) and, given `worker_port`, puts each attempt's worker store on the port it chooses."""

    def __init__(
        self,
        *args: Any,
        tolerated: Callable[[int], bool],
        lost: list[LostWorker],
        worker_port: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._tolerated = tolerated  # pid -> may this worker be lost?
        self._lost = lost  # shared with the launcher, for its report
        self._worker_port = worker_port

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        # One node: the workers' store port is this agent's to choose (torch picks any free port, from the range
        # every other socket on the host draws from, and rank 0 binds it seconds later). Several nodes: node 0's.
        if self._worker_port is not None:
            worker_group.spec.master_port = self._worker_port()
        super()._rendezvous(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        handlers = getattr(self._pcontext, "subprocess_handlers", None)
        if not handlers or not any(self._tolerated(handler.proc.pid) for handler in handlers.values()):
            return super()._monitor_workers(worker_group)
        codes = {local_rank: handler.proc.poll() for local_rank, handler in handlers.items()}
        failed = {local_rank for local_rank, code in codes.items() if code not in (None, 0)}
        lost = {local_rank for local_rank in failed if self._tolerated(handlers[local_rank].proc.pid)}
        known = {worker.local_rank for worker in self._lost}
        for local_rank in sorted(lost - known):
            rank = worker_group.workers[local_rank].global_rank
            self._lost.append(LostWorker(rank, local_rank, int(codes[local_rank])))
        if failed - lost or not lost:  # a real failure (torch stops every worker), or nothing lost yet
            if failed - lost or all(code is not None for code in codes.values()):
                return super()._monitor_workers(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        may_be_lost = {local_rank for local_rank, handler in handlers.items() if self._tolerated(handler.proc.pid)}
        if lost == may_be_lost and all(codes[local_rank] is not None for local_rank in may_be_lost):
            return super()._monitor_workers(worker_group)  # every such worker lost: the job failed after all
        if all(code is not None for code in codes.values()):
            assert self._pcontext is not None
            self._pcontext.close()
            return RunResult(
                state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers}
            )
        return RunResult(state=WorkerState.HEALTHY)


@contextlib.contextmanager
def agent_class(factory: Callable[..., LocalElasticAgent]) -> Iterator[None]:
    """torch's `launch_agent` builds its agent itself, by name: the agent class is swapped for the call (in the
    launcher process, which runs nothing else), then restored."""
    previous = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = factory  # type: ignore[misc,assignment]  # torch's class, swapped for the launch
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = previous  # type: ignore[misc]  # (restored)
