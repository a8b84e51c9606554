"""Accelerate's verbs of `meshkit.Accelerator` (its `accelerate_verbs` component, over the Engine's context), so a
loop written against `accelerate.Accelerator` runs with its calls unchanged: process facts, per-process decorators,
`split_between_processes`, `skip_first_batches`, `end_training`, `get_tracker`, `free_memory`
(`register_for_checkpointing` lives with the checkpoint verbs).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

import torch

from meshkit.core.errors import MeshkitError
from meshkit.data.loader import ShardedLoader
from meshkit.engine.context import EngineComponent

F = TypeVar("F", bound=Callable[..., Any])


class AccelerateVerbs(EngineComponent):
    """Process facts and decorators, trackers and memory, read from the shared context."""

    # ------------------------------------------------------------------ process facts
    @property
    def local_process_index(self) -> int:
        return self.ctx.info.local_rank

    @property
    def is_last_process(self) -> bool:
        return self.ctx.info.rank == self.ctx.info.world_size - 1

    @property
    def mixed_precision(self) -> str:
        """'no', 'bf16' or 'fp16', as Accelerate names them."""
        return self.ctx.config.precision

    # ------------------------------------------------------------------ per-process functions
    def only_where(self, run_here: bool, function: F) -> F:
        """`function`, run where `run_here` holds; elsewhere a call returns None."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if run_here else None

        return cast(F, wrapper)

    def on_main_process(self, function: F) -> F:
        """Decorator: the function runs on the main process only (elsewhere it returns None)."""
        return self.only_where(self.ctx.info.rank == 0, function)

    def on_local_main_process(self, function: F) -> F:
        return self.only_where(self.ctx.info.local_rank == 0, function)

    def on_last_process(self, function: F) -> F:
        return self.only_where(self.is_last_process, function)

    def on_process(self, function: F | None = None, process_index: int = 0) -> Any:
        """Decorator: the function runs on process `process_index` only (`@accelerator.on_process(process_index=1)`)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self.only_where(self.ctx.info.rank == process_index, function)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor or dict of them (the first processes get one
        more when it does not divide); with `apply_padding` every share has the same length, the last item
        repeated — as Accelerate does, e.g. for generation over a prompt list."""
        yield _share(inputs, self.ctx.info.rank, self.ctx.info.world_size, apply_padding)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Start the next pass over a prepared loader at its batch `num_batches` of the current epoch, without
        reading the batches before it (samplers start further in), as when resuming mid-epoch. Returns the same
        loader; the pass after it is a full epoch again. (`load_state`/`resume` already restore the data
        position: calling both for the same batch does not skip twice.)"""
        if not isinstance(dataloader, ShardedLoader):
            raise MeshkitError(
                "skip_first_batches takes a DataLoader returned by accelerator.prepare(), not a "
                f"{type(dataloader).__name__}: prepare it first"
            )
        if num_batches < 0:
            raise MeshkitError(f"skip_first_batches: num_batches is {num_batches}; give a count of 0 or more")
        dataloader.start_at_batch(num_batches)
        return dataloader

    # ------------------------------------------------------------------ trackers and memory
    def end_training(self) -> None:
        """Training is over on this rank: the trackers close, and a parameter-server worker tells the servers
        (they return from `prepare()` once every worker has). `end()` does it too."""
        self.ctx.placement.finish()
        self.ctx.trackers.close()

    def get_tracker(self, name: str) -> Any:
        """The tracker named `name` (`jsonl`, `tensorboard`, `wandb`) on the reporting rank; None elsewhere or when
        the run does not use it. Its `.run` (wandb) or `.writer` (TensorBoard) is the library's own object."""
        if name not in self.ctx.config.logging.trackers:
            raise MeshkitError(
                f"get_tracker('{name}'): the run's trackers are {list(self.ctx.config.logging.trackers)}"
            )
        return next((t for t in self.ctx.trackers.running if getattr(t, "name", None) == name), None)

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop the engine's references to its prepared objects, collect garbage and empty the device cache;
        returns one None per object passed (`model, optimizer = accelerator.free_memory(model, optimizer)`)."""
        self.ctx.objects.forget()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)


def _share(inputs: Any, rank: int, world: int, pad: bool) -> Any:
    if isinstance(inputs, Mapping):
        return {key: _share(value, rank, world, pad) for key, value in inputs.items()}
    length = len(inputs)
    base, extra = divmod(length, world)
    start = rank * base + min(rank, extra)
    part = inputs[start : start + base + (1 if rank < extra else 0)]
    if pad and length:
        need = math.ceil(length / world)
        missing = need - len(part)
        if missing > 0:
            last = inputs[-1:]
            if isinstance(part, torch.Tensor):
                part = torch.cat([part, last.expand(missing, *last.shape[1:])])
            else:
                part = list(part) + list(last) * missing
    return part
