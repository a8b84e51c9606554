"""The parameter server as the engine sees it: a `Placement` (`meshkit.engine.placement`) whose answers come from
the run's roles. A worker keeps its gradients to itself (the servers average them), shares metrics and barriers
with the other workers only, and a lost worker must not stall the rest; the servers keep the weights' checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshkit.config.schema import RunConfig
from meshkit.paramserver.run import EmptyLoader, ParameterServerRun
from meshkit.paramserver.server import ServeReport
from meshkit.runtime.mesh import ParallelMesh
from meshkit.training.accumulation import GradientState, PreparedOptimizer


@dataclass(frozen=True)
class ServedPlacement:
    mesh: ParallelMesh
    run: ParameterServerRun

    @classmethod
    def start_roles(
        cls, mesh: ParallelMesh, config: RunConfig, rank: int, world_size: int, say: Callable[[str], None]
    ) -> ServedPlacement:
        return cls(mesh, ParameterServerRun(config, rank, world_size, say))

    @property
    def zero_stage(self) -> int:
        return self.mesh.dims.zero_stage

    @property
    def grad_group(self) -> Any:
        return self.run.local_group

    @property
    def data_group(self) -> Any:
        return self.run.workers_group

    @property
    def metric_group(self) -> Any:
        return self.run.workers_group

    @property
    def barrier_group(self) -> Any:
        return self.run.workers_group

    @property
    def dp_rank(self) -> int:
        return self.run.roles.worker_index or 0

    @property
    def dp_size(self) -> int:
        return self.run.roles.num_workers

    @property
    def is_worker(self) -> bool:
        return not self.run.is_server

    @property
    def reporting_rank(self) -> int:
        return self.run.roles.servers  # (rank 0 serves)

    shares_gradients = False
    every_rank_meets = False

    @property
    def steps_together(self) -> bool:
        return self.run.settings.mode != "async"

    @property
    def checkpoint_store(self) -> ParameterServerRun:
        return self.run

    def describe(self) -> str:
        return f"parameter server ({self.run.roles.servers} server(s), {self.run.settings.mode})"

    def own_loader(self, loader: Any) -> Any | None:
        return EmptyLoader(loader) if self.run.is_server else None

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, models: list[nn.Module], state: GradientState
    ) -> PreparedOptimizer | None:
        return self.run.prepare_optimizer(optimizer, models, state)

    def start(self, optimizers: list[PreparedOptimizer], schedulers: list[Any]) -> None:
        self.run.start(optimizers, schedulers)  # (a server serves here until the workers finish: maybe days)

    def finish(self) -> None:
        self.run.finish()


def serve_report(placement: object) -> ServeReport | None:
    """What the servers applied (staleness, lost workers), on a server's rank once it served; None elsewhere."""
    return placement.run.report if isinstance(placement, ServedPlacement) else None
