"""A server rank's loop: receive gradients, apply them under the staleness bound, answer with parameters.

One thread per worker receives its requests (a receive from a dead worker fails when its connection closes,
so a death arrives like any message); this thread applies them in order. A worker that pushed the gradient of
its step t is answered once every active worker has pushed step t - max_staleness: the answer then carries every
gradient received so far, applied as one optimizer step (the sum of the gradients waiting, each weighted by its
items over the items of one step of all workers). With bound 0 that is one step per step of all workers, in
worker order: synchronous training, DDP's weights.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshkit.config.schema import MAX_SECONDS, ParameterServerConfig
from meshkit.core.errors import MeshkitError
from meshkit.paramserver.checkpoint import read_server_shard, write_server_shard
from meshkit.paramserver.layout import Shard
from meshkit.paramserver.protocol import Kind, Reply, Request, recv_request, send_reply
from meshkit.paramserver.roles import ParameterServerError

IDLE = timedelta(seconds=MAX_SECONDS)  # a worker's next request may come any time: only its death ends the wait


@dataclass
class ServeReport:
    """What a server did, for the summary and for tests (staleness is counted in steps of all workers)."""

    optimizer_steps: int = 0
    gradients: int = 0
    version: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    dead_workers: list[int] = field(default_factory=list)

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)


class ParameterServer:
    def __init__(
        self,
        *,
        rank: int,
        workers: list[int],
        group: dist.ProcessGroup,
        shard: Shard,
        parameters: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        schedulers: list[Any],
        config: ParameterServerConfig,
        say: Callable[[str], None],
    ) -> None:
        self.rank, self.group, self.shard, self.say = rank, group, shard, say
        self.named = list(zip(shard.names, parameters, strict=True))
        self.optimizer, self.schedulers = optimizer, schedulers
        self.bound = 0 if config.mode == "sync" else config.max_staleness  # None: unbounded
        self.sync = config.mode == "sync"
        self.staleness_lr = config.staleness_lr
        self.clock = dict.fromkeys(workers, 0)  # gradients each worker has pushed
        self.applied = dict.fromkeys(workers, 0)  # of those, the ones in the parameters now
        self.items = dict.fromkeys(workers, 1.0)  # each worker's items per step (its weight)
        self.active = set(workers)  # neither done nor dead
        self.pending: dict[int, Request] = {}  # gradients received, not applied yet
        self.waiting: dict[int, int] = {}  # worker -> the version its answer waits for
        self.saving: dict[int, Request] = {}
        self.loading: dict[int, Request] = {}
        self.report = ServeReport()
        self._scheduled = 0  # versions the schedulers have stepped for
        self._flat: torch.Tensor | None = None  # the parameters as last sent (until the next step)
        self._sends: dict[int, list[dist.Work]] = {}
        self._inbox: queue.Queue[tuple[int, Request | BaseException]] = queue.Queue()

    # ------------------------------------------------------------------ the loop
    def serve(self) -> ServeReport:
        for worker in sorted(self.active):
            threading.Thread(
                target=self._receive, args=(worker,), name=f"meshkit-ps-recv-{worker}", daemon=True
            ).start()
        while self.active:
            worker, message = self._inbox.get()
            if isinstance(message, BaseException):
                self._lost(worker, message)
            else:
                self._handle(worker, message)
            self._advance()
        for works in self._sends.values():
            _settle(works)
        self.report.version = self.parameters_version
        return self.report

    def _receive(self, worker: int) -> None:
        while True:
            try:
                request = recv_request(worker, self.shard.numel, self.shard.dtype, self.group, IDLE)
            except BaseException as err:  # noqa: BLE001 - the connection to this worker is gone
                self._inbox.put((worker, err))
                return
            self._inbox.put((worker, request))
            if request.kind == Kind.DONE:
                return

    @property
    def version(self) -> int:
        """Steps every active worker has pushed: an answer waits for this to reach its bound."""
        return min((self.clock[w] for w in self.active), default=max(self.clock.values(), default=0))

    @property
    def parameters_version(self) -> int:
        """Steps of every active worker the parameters hold: the version a gradient is computed on, and its
        staleness when applied is how far the parameters have moved on since."""
        return min((self.applied[w] for w in self.active), default=max(self.applied.values(), default=0))

    def _handle(self, worker: int, request: Request) -> None:
        if request.kind == Kind.PULL:
            self._answer(worker)
        elif request.kind == Kind.EXCHANGE:
            self.pending[worker] = request
            self.clock[worker] = request.clock + 1
            self.items[worker] = request.items
            self.report.gradients += 1
            # answered once every active worker pushed the step `bound` behind this one (unbounded: at once)
            self.waiting[worker] = 0 if self.bound is None else self.clock[worker] - self.bound
        elif request.kind == Kind.SAVE:
            self.saving[worker] = request
        elif request.kind == Kind.LOAD:
            self.loading[worker] = request
        elif request.kind == Kind.DONE:
            self.active.discard(worker)

    def _lost(self, worker: int, err: BaseException) -> None:
        if worker not in self.active:
            return
        if self.sync:
            raise ParameterServerError(
                f"worker rank {worker} is gone ({_first_line(err)}): synchronous parameter-server training stops "
                "(ps.mode=async goes on without a lost worker); restart with checkpoint.resume=auto"
            )
        self.active.discard(worker)
        self.waiting.pop(worker, None)
        self.saving.pop(worker, None)
        self.loading.pop(worker, None)
        self.report.dead_workers.append(worker)
        going_on = f"training goes on with {len(self.active)} worker(s)" if self.active else "the others had finished"
        self.say(
            f"meshkit: parameter server: worker rank {worker} is gone at its step {self.clock[worker]}; {going_on}"
        )

    def _advance(self) -> None:
        version = self.version
        for worker in sorted(self.waiting):
            if version >= self.waiting[worker]:
                del self.waiting[worker]
                self._apply()
                self._answer(worker)
        while self._scheduled < version:
            for scheduler in self.schedulers:
                scheduler.step()
            self._scheduled += 1
        if self.saving and set(self.saving) >= self.active:
            self._save()
        if self.loading and set(self.loading) >= self.active:
            self._load()

    # ------------------------------------------------------------------ steps
    def _apply(self) -> None:
        if not self.pending:
            return
        version = self.parameters_version
        per_step = sum(self.items[w] for w in self.active | set(self.pending))
        total = torch.zeros(self.shard.numel, dtype=self.shard.dtype)
        for worker in sorted(self.pending):
            request = self.pending[worker]
            staleness = max(0, version - request.version)
            self.report.staleness[staleness] += 1
            weight = request.items / per_step / ((1 + staleness) if self.staleness_lr else 1)
            assert request.gradient is not None
            total.add_(request.gradient, alpha=weight)
            self.applied[worker] += 1
        self.pending.clear()
        for (_, param), grad in zip(self.named, self.shard.views(total), strict=True):
            param.grad = grad.to(param.device, param.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.report.optimizer_steps += 1
        self._flat = None

    def _parameters(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = self.shard.flatten([param for _, param in self.named])
        return self._flat

    def _answer(self, worker: int, **extra: Any) -> None:
        _settle(self._sends.pop(worker, []))  # the previous answer: received, since the worker asked again
        reply = Reply(self.parameters_version, parameters=None if extra.get("error") else self._parameters(), **extra)
        self._sends[worker] = send_reply(reply, worker, self.group)

    # ------------------------------------------------------------------ checkpoints
    def _save(self) -> None:
        requests, self.saving = self.saving, {}
        self._apply()
        directory = Path(next(iter(requests.values())).text)
        progress = {"clocks": {str(w): c for w, c in self.clock.items()}, "version": self.parameters_version}
        error = ""
        try:
            write_server_shard(directory, self.rank, self.named, self.optimizer, self.schedulers, progress)
        except (OSError, RuntimeError, ValueError) as err:
            error = f"parameter server rank {self.rank} could not write {directory}: {_first_line(err)}"
        committer = min(requests)
        for worker in sorted(requests):
            self._answer(worker, error=error, commit=worker == committer)

    def _load(self) -> None:
        requests, self.loading = self.loading, {}
        directory = Path(next(iter(requests.values())).text)
        error, clock = "", 0
        try:
            progress = read_server_shard(directory, self.named, self.optimizer, self.schedulers)
            clock = int(progress.get("version", 0))
        except (OSError, RuntimeError, ValueError, KeyError, MeshkitError) as err:
            error = f"parameter server rank {self.rank} could not load {directory}: {_first_line(err)}"
        if not error:
            for worker in self.clock:
                self.clock[worker] = self.applied[worker] = clock
            self.pending.clear()
            self._scheduled = clock
            self._flat = None
        for worker in sorted(requests):
            self._answer(worker, error=error, clock=clock)


def _settle(works: list[dist.Work]) -> None:
    for work in works:
        with contextlib.suppress(RuntimeError):  # the worker is gone; its death reaches the loop by its thread
            work.wait()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
