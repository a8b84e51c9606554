"""What the engine's components share: the resolved config, this process, where it sits in the layout, the
prepared objects and the run's services (trackers, checkpointer, preemption watch, hang doctor).

The Engine owns one `EngineContext` and hands it to each component it is built from (checkpoints, processes,
weights, evaluation, Accelerate's verbs). When `layout: auto` settles, the engine replaces `placement` and
`config` here, and every component sees the new layout at once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor.parallel import loss_parallel as tensor_parallel_loss

from meshkit.config.schema import RunConfig
from meshkit.core.tree import map_tensors
from meshkit.engine.placement import Placement
from meshkit.engine.prepared_objects import PreparedObjects
from meshkit.parallel.context.apply import shard_sequence
from meshkit.runtime.hang_doctor import HangDoctor
from meshkit.runtime.mesh import ParallelMesh, ProcessInfo
from meshkit.runtime.preemption import PreemptionWatch
from meshkit.runtime.tracking import TrackerSet
from meshkit.training.accumulation import GradientState
from meshkit.training.loss import is_causal_lm_batch, shifted_for_split


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
