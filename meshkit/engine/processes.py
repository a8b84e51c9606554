"""Coordinating the ranks: process facts, metrics over the data-parallel ranks, barriers, main-process work and
logging — the `Engine`'s `processes` component."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshkit.core.errors import MeshkitError
from meshkit.core.tree import has_tensors, map_tensors
from meshkit.engine.context import EngineComponent, EngineContext, print_once_per_node
from meshkit.runtime import collectives
from meshkit.runtime.hang_doctor import watched
from meshkit.runtime.tracking import TrackerStart, scalar_metrics


class MetricsError(MeshkitError):
    """A metric gathered over ranks that do not stand at the same place in the data."""


class Processes(EngineComponent):
    """gather / gather_for_metrics / reduce, wait_for_everyone, main_process_first, print, log."""

    def __init__(self, ctx: EngineContext, monitor_group: Callable[[], Any]) -> None:
        super().__init__(ctx)
        self._monitor_group = monitor_group  # a gloo group, for monitored_barrier (the checkpointer's)

    @property
    def process_index(self) -> int:
        return self.ctx.info.rank

    @property
    def num_processes(self) -> int:
        return self.ctx.info.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that read different data (a parameter-server worker's index)."""
        return self.ctx.placement.dp_rank

    @property
    def dp_size(self) -> int:
        return self.ctx.placement.dp_size

    @property
    def is_worker(self) -> bool:
        """False on a parameter server's rank (its prepare() serves until the workers finish); True otherwise."""
        return self.ctx.placement.is_worker

    @property
    def is_main_worker(self) -> bool:
        """The rank that reports training (progress, trackers, summary): rank 0, or in a parameter-server run the
        first worker (rank 0 serves)."""
        return self.ctx.info.rank == self.ctx.placement.reporting_rank

    @property
    def is_main_process(self) -> bool:
        return self.ctx.info.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.ctx.info.local_rank == 0

    @watched("gather")
    def gather(self, data: Any) -> Any:
        """Concatenate tensors from every dp rank along dim 0 (same shapes on every rank)."""
        return collectives.gather(data, self.ctx.placement.data_group)

    @watched("gather_for_metrics")
    def gather_for_metrics(self, data: Any) -> Any:
        """`gather`, minus the samples the sampler repeated to even out the last batch, in the sampler's order:
        metrics see the dataset exactly, and an unshuffled loader's predictions come back in dataset order. Call it
        inside the loop over a prepared loader (it trims that loader's current batch). Batches are dealt whole,
        so the padding is the gathered rows' tail, cut as Accelerate cuts it (also from rows that are not the
        batch's samples, such as a repeated loss)."""
        loader = self.ctx.gradient_state.active_loader
        counts = self._agreed_counts(loader)
        interleaved = loader is not None and loader.interleaved()
        if has_tensors(data):
            gathered = self.gather(data)
            if counts is None:
                return gathered
            if not interleaved:  # whole batches dealt: the real samples come first, the padding last
                return map_tensors(lambda t: t[: sum(counts)], gathered)
            return map_tensors(lambda t: collectives.in_sampler_order(t, counts), gathered)
        # Other objects (strings, ids): each rank passes a list of per-sample items.
        per_rank = collectives.gather_object(list(data), self.ctx.placement.data_group)
        if counts is None:
            return [item for items in per_rank for item in items]
        if not interleaved:
            return [item for items in per_rank for item in items][: sum(counts)]
        return [per_rank[r][j] for j in range(max(counts)) for r in range(len(per_rank)) if j < counts[r]]

    def _agreed_counts(self, loader: Any) -> list[int] | None:
        """The real samples per rank of the loader's current batch, from a place every rank agrees on: the ranks
        exchange where they stand (epoch, batch, the epoch's start) first, so that what is cut never depends on
        one rank's bookkeeping or on timing; ranks at different places are refused in one line."""
        group = self.ctx.placement.data_group
        if collectives.group_size(group) > 1:
            place = loader.place() if loader is not None else (-1, -1, -1)
            marks = collectives.gather_tensor(torch.tensor(place, device=self.ctx.device), group).view(-1, 3).tolist()
            if any(mark != marks[0] for mark in marks):
                where = ", ".join(
                    f"rank {r}: {'no loop' if m[1] < 0 else f'epoch {m[0]} batch {m[1]}'}" for r, m in enumerate(marks)
                )
                raise MetricsError(
                    f"gather_for_metrics: the ranks stand at different batches of the data ({where}); call it once per "
                    "batch on every rank, inside the loop over the same prepared loader"
                )
        return loader.valid_counts() if loader is not None else None

    @watched("reduce")
    def reduce(self, data: Any, op: str = "mean") -> Any:
        """All-reduce tensors over the ranks that hold different data, dp × cp ('mean' or 'sum'): the mean of
        per-rank mean losses is the batch's mean loss."""
        return collectives.reduce(data, self.ctx.placement.metric_group, op=op)

    @watched("wait_for_everyone")
    def wait_for_everyone(self) -> None:
        """Barrier over all ranks (over the workers in a parameter-server run; a server returns at once)."""
        if not self.is_worker:
            return
        group = self.ctx.placement.barrier_group
        device = self.ctx.device
        if device.type == "cuda":
            dist.barrier(group=group, device_ids=[device.index])
        else:
            dist.barrier(group=group)

    @contextlib.contextmanager
    def main_process_first(self, per_node: bool = False) -> Iterator[None]:
        """The main process runs the block first (e.g. downloads, preprocessing), then the others; `per_node`:
        each node's first process, then the node's others (a cache on each node's disk)."""
        first = self.is_local_main_process if per_node else self.is_main_process
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_work(self, timeout_s: float = 24 * 3600.0) -> Iterator[bool]:
        """Work only the main process does (evaluation, saving, uploads) that may outlast `collective_timeout_s`.

            with engine.main_process_work(timeout_s=3600) as is_main:
                if is_main:
                    evaluate_and_save()

        The other ranks wait at the end of the block in a barrier with `timeout_s` of its own, instead of in
        their next collective, which would time out (and be reported as a hang) after `collective_timeout_s`.
        """
        yield self.is_main_process
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        doctor = self.ctx.hang_doctor
        phase = doctor.phase("main_process_work", lambda: self.step, timeout_s) if doctor else contextlib.nullcontext()
        with phase:
            timeout = timedelta(seconds=timeout_s)
            dist.monitored_barrier(group=self._monitor_group(), timeout=timeout, wait_all_ranks=True)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() once per node."""
        print_once_per_node(self.ctx.info, *args, **kwargs)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Send scalar metrics to the trackers (on `is_main_worker`; other ranks return at once)."""
        trackers = self.ctx.trackers.running
        if not trackers:
            return
        scalars = scalar_metrics(metrics)
        for tracker in trackers:
            tracker.log(scalars, step)

    def start_trackers(
        self,
        project_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Start the run's trackers (`logging.trackers`) with a project name (the wandb project), your run
        configuration (wandb config, TensorBoard hparams, `hparams.json` beside `metrics.jsonl`) and keyword
        arguments per tracker (`{"wandb": {"tags": [...]}}` for `wandb.init`, `{"tensorboard": {...}}` for
        `SummaryWriter`). Optional: without it the trackers start at the first `log()`."""
        self.ctx.trackers.start(TrackerStart(project_name, dict(config or {}), dict(init_kwargs or {})))
