"""What the engine's components share: the resolved config, this process, where it sits in the layout, the
prepared objects and the run's services (trackers, checkpointer, preemption watch, hang doctor).

The Engine owns one `EngineContext` and hands it to each component it is built from (checkpoints, processes,
weights, evaluation, Accelerate's verbs). When `layout: auto` settles, the engine replaces `placement` and
`config` here, and every component sees the new layout at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.tensor.parallel import loss_parallel as tensor_parallel_loss

from meshkit.config.layout import Layout, check_pipeline
from meshkit.config.schema import RunConfig
from meshkit.core.tree import map_tensors
from meshkit.engine.prepared_objects import PreparedObjects
from meshkit.parallel.context.apply import shard_sequence
from meshkit.parallel.dataparallel import check_world
from meshkit.parallel.zero.nvme import check_offload_dir
from meshkit.parallel.zero.sharding import effective_zero_stage
from meshkit.paramserver.run import ParameterServerRun
from meshkit.runtime.hang_doctor import HangDoctor
from meshkit.runtime.mesh import ParallelMesh, ProcessInfo
from meshkit.runtime.preemption import PreemptionWatch
from meshkit.runtime.tracking import TrackerSet
from meshkit.training.accumulation import GradientState
from meshkit.training.loss import is_causal_lm_batch, shifted_for_split


@dataclass(frozen=True)
class Placement:
    """This rank's place in the run's layout, made once the layout is known (again when `layout: auto` chose)."""

    mesh: ParallelMesh  # its `dims` is the run's Layout, with the ZeRO stage the run really gets
    ps: ParameterServerRun | None  # strategy: parameter_server

    @property
    def zero_stage(self) -> int:
        return self.mesh.dims.zero_stage

    # Where each kind of traffic goes. A parameter-server worker keeps its gradients to itself (the servers
    # average them) and shares metrics and barriers with the other workers only.
    @property
    def grad_group(self) -> Any:
        return self.ps.local_group if self.ps else self.mesh.grad_group

    @property
    def data_group(self) -> Any:
        return self.ps.workers_group if self.ps else self.mesh.dp_group

    @property
    def metric_group(self) -> Any:
        return self.ps.workers_group if self.ps else self.mesh.grad_group

    @property
    def barrier_group(self) -> Any:
        return self.ps.workers_group if self.ps else None

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that read different data (a parameter-server worker's index)."""
        return (self.ps.roles.worker_index or 0) if self.ps else self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.ps.roles.num_workers if self.ps else self.mesh.dp_size

    @property
    def is_worker(self) -> bool:
        """False on a parameter server's rank (its prepare() serves until the workers finish)."""
        return self.ps is None or not self.ps.is_server

    @property
    def reporting_rank(self) -> int:
        """The rank that reports training: rank 0, or in a parameter-server run the first worker (rank 0 serves)."""
        return self.ps.roles.servers if self.ps else 0


def place(config: RunConfig, info: ProcessInfo, device: torch.device, say: Callable[[str], None]) -> Placement:
    """Validate the layout against the world and build the mesh (and the parameter-server roles)."""
    dims = Layout.from_config(config.parallel, info.world_size)
    if dims.pp > 1:
        check_pipeline(config.pipeline, dims.pp, grad_accum_steps=config.grad_accum_steps)
    if config.strategy == "dataparallel":
        check_world(info.world_size)
    layout = replace(dims, zero_stage=effective_zero_stage(config.sharding, dims))
    mesh = ParallelMesh(layout, info, device)
    ps = ParameterServerRun(config, info.rank, info.world_size, say) if config.strategy == "parameter_server" else None
    if config.sharding.offload == "nvme" and config.sharding.offload_dir is not None:  # (the schema requires one)
        check_offload_dir(config.sharding.offload_dir)
    return Placement(mesh, ps)


@dataclass
class EngineContext:
    config: RunConfig
    info: ProcessInfo
    device: torch.device
    placement: Placement
    gradient_state: GradientState
    scaler: Any  # torch.amp.GradScaler under fp16, else None
    objects: PreparedObjects
    trackers: TrackerSet
    preemption: PreemptionWatch
    hang_doctor: HangDoctor | None

    @property
    def mesh(self) -> ParallelMesh:
        return self.placement.mesh

    def loss_parallel(self) -> contextlib.AbstractContextManager[Any]:
        """Cross-entropy from vocab-sharded logits (tensor parallel) without gathering them; else nothing."""
        return tensor_parallel_loss() if self.objects.logits_sharded else contextlib.nullcontext()

    def shard_sequence(self, batch: Any, dim: int = 1) -> Any:
        """Under context parallel, this rank's two chunks of every tensor's sequence dim; else the batch. A causal
        LM's HF batch (input_ids, labels) gets its labels shifted first, so `model(**chunks).loss` is right."""
        cp = self.mesh.size("cp")
        if cp == 1:
            return batch
        split = lambda t: shard_sequence(t, cp, self.mesh.coordinate("cp"), dim)  # noqa: E731
        if self.objects.causal_lm and is_causal_lm_batch(batch):
            shifted = shifted_for_split(batch, cp, self.objects.label_shift)
            items = shifted.pop("num_items_in_batch")
            return {**map_tensors(split, shifted), "num_items_in_batch": items}
        return map_tensors(split, batch)


class EngineComponent:
    """A part of the Engine: it reads the shared context, and its collective methods are watched by the hang
    doctor (`runtime.hang_doctor.watched` looks for `hang_doctor` and `step`)."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    @property
    def hang_doctor(self) -> HangDoctor | None:
        return self.ctx.hang_doctor

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by `load_state`)."""
        return self.ctx.objects.step


def print_once_per_node(info: ProcessInfo, *args: Any, **kwargs: Any) -> None:
    """print() on each node's first process."""
    if info.local_rank == 0:
        print(*args, **kwargs)
