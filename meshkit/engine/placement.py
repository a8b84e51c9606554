"""Where this rank sits in the run's layout, and what follows from it for the engine: where each kind of traffic goes,
which ranks read data, who prepares the optimizer's update, whether every rank meets in each collective, and who
keeps the checkpoints.

Every strategy is reached through one `Placement`: the mesh layouts (DDP, ZeRO, tp, pp, cp, ep and their
combinations, `MeshPlacement`) and the parameter server (`meshkit.paramserver.placement.ServedPlacement`). The
engine asks these questions and never which strategy runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from meshkit.config.layout import Layout, check_pipeline
from meshkit.config.schema import RunConfig
from meshkit.parallel.dataparallel import check_world
from meshkit.parallel.zero.nvme import check_offload_dir
from meshkit.parallel.zero.sharding import effective_zero_stage
from meshkit.paramserver.placement import ServedPlacement
from meshkit.runtime.mesh import ParallelMesh, ProcessInfo
from meshkit.training.accumulation import GradientState, PreparedOptimizer


class CheckpointStore(Protocol):
    """Checkpoints a placement keeps its own way (the parameter server: the servers write the weights)."""

    def save(
        self, partial: Path, finish: Callable[[Path], Any], step: int, extra: dict[str, Any], loaders: list[Any],
        registered: list[Any],
    ) -> None: ...  # fmt: skip

    def load(
        self, directory: Path, optimizers: list[PreparedOptimizer], schedulers: list[Any], loaders: list[Any]
    ) -> dict[str, Any]: ...

    def resume_choice(self, resume: str, root: Path) -> str | None: ...


class Placement(Protocol):
    """This rank's place in the run's layout, made once the layout is known (again when `layout: auto` chose)."""

    @property
    def mesh(self) -> ParallelMesh:
        """The device mesh; its `dims` is the run's Layout, with the ZeRO stage the run really gets."""
        ...

    @property
    def zero_stage(self) -> int: ...

    @property
    def grad_group(self) -> Any:
        """Where gradients are averaged (a group of one where they are sent elsewhere)."""
        ...

    @property
    def data_group(self) -> Any:
        """The ranks that read different data."""
        ...

    @property
    def metric_group(self) -> Any:
        """The ranks a metric is averaged over."""
        ...

    @property
    def barrier_group(self) -> Any:
        """The ranks `wait_for_everyone` meets (None: every rank)."""
        ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def is_worker(self) -> bool:
        """False on a rank that does not train (a parameter server: its prepare() serves until the workers end)."""
        ...

    @property
    def reporting_rank(self) -> int:
        """The rank that reports training (the first worker)."""
        ...

    @property
    def shares_gradients(self) -> bool:
        """Whether the data-parallel ranks average gradients through the mesh's collectives (DDP, ZeRO)."""
        ...

    @property
    def every_rank_meets(self) -> bool:
        """Whether every rank takes part in each step's collectives to the end (preemption agreement, resume
        choice, the closing barrier); False where a lost rank must not stall the rest."""
        ...

    @property
    def steps_together(self) -> bool:
        """Whether the training ranks step together (a loss averaged over them each step is every rank's)."""
        ...

    @property
    def checkpoint_store(self) -> CheckpointStore | None:
        """The placement's own checkpoints, or None: the engine's sharded checkpoints of the mesh."""
        ...

    def describe(self) -> str:
        """The layout in words, for banners and summaries."""
        ...

    def own_loader(self, loader: Any) -> Any | None:
        """The loader this rank gets instead of its data-parallel share (a server's empty one), or None."""
        ...

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, models: list[nn.Module], state: GradientState
    ) -> PreparedOptimizer | None:
        """The optimizer when this placement updates the weights its own way, or None (the layout's own)."""
        ...

    def start(self, optimizers: list[PreparedOptimizer], schedulers: list[Any]) -> None:
        """After prepare(): what the placement starts (a worker pulls the weights; a server serves)."""
        ...

    def finish(self) -> None:
        """Training is over on this rank."""
        ...


@dataclass(frozen=True)
class MeshPlacement:
    """The mesh layouts: every rank trains, gradients and metrics are averaged over the mesh's groups."""

    mesh: ParallelMesh

    @property
    def zero_stage(self) -> int:
        return self.mesh.dims.zero_stage

    @property
    def grad_group(self) -> Any:
        return self.mesh.grad_group

    @property
    def data_group(self) -> Any:
        return self.mesh.dp_group

    @property
    def metric_group(self) -> Any:
        return self.mesh.grad_group

    @property
    def barrier_group(self) -> Any:
        return None

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    is_worker = True
    reporting_rank = 0
    shares_gradients = True
    every_rank_meets = True
    steps_together = True
    checkpoint_store = None

    def describe(self) -> str:
        return self.mesh.dims.describe()

    def own_loader(self, loader: Any) -> Any | None:
        return None

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, models: list[nn.Module], state: GradientState
    ) -> PreparedOptimizer | None:
        return None

    def start(self, optimizers: list[PreparedOptimizer], schedulers: list[Any]) -> None:
        pass

    def finish(self) -> None:
        pass


def place(config: RunConfig, info: ProcessInfo, device: torch.device, say: Callable[[str], None]) -> Placement:
    """Validate the layout against the world and build the mesh (and, under `strategy: parameter_server`, the
    servers' and workers' roles)."""
    dims = Layout.from_config(config.parallel, info.world_size)
    if dims.pp > 1:
        check_pipeline(config.pipeline, dims.pp, grad_accum_steps=config.grad_accum_steps)
    if config.strategy == "dataparallel":
        check_world(info.world_size)
    layout = replace(dims, zero_stage=effective_zero_stage(config.sharding, dims))
    mesh = ParallelMesh(layout, info, device)
    if config.sharding.offload == "nvme" and config.sharding.offload_dir is not None:  # (the schema requires one)
        check_offload_dir(config.sharding.offload_dir)
    if config.strategy == "parameter_server":
        return ServedPlacement.start_roles(mesh, config, info.rank, info.world_size, say)
    return MeshPlacement(mesh)
