"""The engine's part in a parameter-server run: groups, roles, the optimizer each role gets, serving, checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkit.checkpoint.directory import remove_partials, resolve_resume
from meshkit.checkpoint.extras import set_rng_state
from meshkit.checkpoint.storage import CheckpointError
from meshkit.config.schema import RunConfig
from meshkit.paramserver.checkpoint import (
    read_meta,
    read_server_schedulers,
    read_worker_file,
    write_meta,
    write_worker_file,
)
from meshkit.paramserver.client import ParameterClient
from meshkit.paramserver.layout import make_shards
from meshkit.paramserver.roles import ParameterServerError, check_parameter_server
from meshkit.paramserver.server import ParameterServer, ServeReport
from meshkit.runtime import collectives
from meshkit.runtime.preemption import declare_tolerated_exit
from meshkit.training.accumulation import GradientState, PreparedOptimizer


class ServedOptimizer(PreparedOptimizer):
    """A worker's optimizer: `step()` pushes the gradients and pulls the servers' parameters; the update
    itself runs on the servers (the wrapped optimizer never steps here, so it holds no state)."""

    def __init__(self, optimizer: torch.optim.Optimizer, state: GradientState, client: ParameterClient) -> None:
        super().__init__(optimizer, state, None)
        self.client = client

    def step(self, closure: Any = None) -> Any:
        if not self.gradient_state.sync:
            return None
        if closure is not None:
            raise ParameterServerError("optimizer.step(closure) is not supported with strategy=parameter_server")
        self.steps_taken += 1
        self.client.exchange(self.gradient_state.last_window_items or 1.0)
        self.step_was_skipped = False
        self.gradient_state.optimizer_stepped = True
        return None


class EmptyLoader:
    """A server's prepared DataLoader: servers read no data."""

    def __init__(self, loader: Any) -> None:
        self.dataset, self.batch_size = loader.dataset, loader.batch_size

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0

    def set_epoch(self, epoch: int) -> None:
        pass

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class ParameterServerRun:
    def __init__(self, config: RunConfig, rank: int, world_size: int, say: Callable[[str], None]) -> None:
        if config.precision == "fp16":
            raise ParameterServerError(
                "strategy=parameter_server does not take fp16 loss scaling: use precision=bf16 or fp32"
            )
        self.settings = config.ps
        self.roles = check_parameter_server(config, world_size, rank)
        self.say = say
        # Collective over the world (every rank creates every group, at the start, while all are alive).
        # the servers' traffic, gloo also under NCCL; a worker waits for an answer up to the collective timeout
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.collective_timeout_s))
        self.workers_group = dist.new_group(ranks=self.roles.worker_ranks)  # metrics among workers
        self.local_group, _ = dist.new_subgroups(group_size=1)  # a worker's gradients are its own until pushed
        if config.ps.mode == "async" and not self.roles.is_server:
            declare_tolerated_exit()  # under meshkit launch, the others go on if this worker is lost
        self.client: ParameterClient | None = None
        self.report: ServeReport | None = None
        self._started = False

    @property
    def is_server(self) -> bool:
        return self.roles.is_server

    # ------------------------------------------------------------------ prepare
    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, models: list[nn.Module], state: GradientState
    ) -> PreparedOptimizer:
        if len(models) != 1:
            raise ParameterServerError(
                "strategy=parameter_server serves one model: prepare exactly one model before its optimizer"
            )
        named = [(name, p) for name, p in models[0].named_parameters() if p.requires_grad]
        shards = make_shards(named, self.roles.servers)
        self._shards, self._named = shards, dict(named)
        if self.is_server:
            mine = set(shards[self.roles.rank].names)
            owned = {id(p) for name, p in named if name in mine}
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in owned]
            with torch.no_grad():
                for name, param in named:  # a server holds its share of the weights only
                    if name not in mine:
                        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            return PreparedOptimizer(optimizer, state, None)
        self.client = ParameterClient(
            servers=self.roles.server_ranks, group=self.group, shards=shards, parameters=self._named
        )
        return ServedOptimizer(optimizer, state, self.client)

    def start(self, optimizers: list[PreparedOptimizer], schedulers: list[Any]) -> None:
        """After prepare(): a worker pulls the servers' weights; a server serves until every worker is done."""
        if self._started or not optimizers:
            return
        self._started = True
        if not self.is_server:
            assert self.client is not None
            self.client.pull()
            return
        shard = self._shards[self.roles.rank]
        server = ParameterServer(
            rank=self.roles.rank,
            workers=self.roles.worker_ranks,
            group=self.group,
            shard=shard,
            parameters=[self._named[name] for name in shard.names],
            optimizer=optimizers[0].optimizer,
            schedulers=[getattr(s, "scheduler", s) for s in schedulers],
            config=self.settings,
            say=self.say,
        )
        self.report = server.serve()
        if self.roles.rank == 0:
            self.say(_summary(self.report, self.roles.num_workers))

    def finish(self) -> None:
        if self.client is not None:
            self.client.finish()
            self.client = None

    # ------------------------------------------------------------------ checkpoints (workers)
    def save(
        self,
        partial: Path,
        finish: Callable[[Path], Any],
        step: int,
        extra: dict[str, Any],
        loaders: list[Any],
        registered: list[Any],
    ) -> None:
        if self.client is None:
            return  # a server saves when the workers ask, while it serves
        partial.mkdir(parents=True, exist_ok=True)
        index = self.roles.worker_index or 0
        write_worker_file(partial, self.roles.rank, index, step, [loader.state_dict() for loader in loaders])
        if self.client.save(partial):
            meta = {"step": step, "servers": self.roles.servers, "workers": self.roles.num_workers, "extra": extra}
            meta["registered"] = registered  # (the first worker's: `register_for_checkpointing`)
            write_meta(partial, meta)
            finish(partial)
            remove_partials(partial.parent)

    def load(
        self, directory: Path, optimizers: list[PreparedOptimizer], schedulers: list[Any], loaders: list[Any]
    ) -> dict[str, Any]:
        if self.client is None:
            return {}
        meta = read_meta(directory)
        step = self.client.load(directory)
        for optimizer in optimizers:
            optimizer.steps_taken = step
        record = read_worker_file(directory, self.roles.worker_index or 0)
        if record is not None:
            for loader, state in zip(loaders, record.get("loaders", []), strict=False):
                loader.load_state_dict(state)
            if record.get("rng"):
                set_rng_state(record["rng"])
        for scheduler, state in zip(schedulers, read_server_schedulers(directory), strict=False):
            scheduler.load_state_dict(state)
        return meta.get("extra", {})

    def resume_choice(self, resume: str, root: Path) -> str | None:
        """The checkpoint `resume` names, decided by the first worker for all workers."""
        choice: tuple[str, str | None] = ("ok", None)
        if self.roles.worker_index == 0:
            try:
                found = resolve_resume(resume, root)
                choice = ("ok", str(found) if found else None)
            except CheckpointError as err:
                choice = ("error", str(err))
        kind, value = collectives.broadcast_object(choice, src=self.roles.servers, group=self.workers_group)
        if kind == "error":
            raise CheckpointError(value)
        return value


def _summary(report: ServeReport, workers: int) -> str:
    mean = sum(k * n for k, n in report.staleness.items()) / max(1, sum(report.staleness.values()))
    lost = f"; lost worker rank(s) {', '.join(map(str, report.dead_workers))}" if report.dead_workers else ""
    return (
        f"meshkit: parameter server applied {report.gradients} gradients from {workers} workers in "
        f"{report.optimizer_steps} optimizer steps (staleness max {report.max_staleness}, mean {mean:.2f}){lost}"
    )
