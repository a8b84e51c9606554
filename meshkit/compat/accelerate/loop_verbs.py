"""More of Accelerate's verbs of `meshkit.Accelerator` (its `accelerate_loop_verbs` component), for loops written
against `accelerate.Accelerator`:
the `prepare_*` forms, `get_state_dict`, `pad_across_processes`, `local_main_process_first`, `on_local_process`,
`set_trigger` / `check_trigger`, `clear`, `gradient_accumulation_steps`, `use_distributed`, `autocast`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshkit.compat.accelerate.verbs import AccelerateVerbs
from meshkit.core.tree import map_tensors
from meshkit.engine.context import EngineComponent, EngineContext
from meshkit.engine.processes import Processes
from meshkit.engine.weights import Weights
from meshkit.training.precision import autocast_context


class AccelerateLoopVerbs(EngineComponent):
    """Built on the engine's `prepare` and its other components (processes, weights, the first verbs)."""

    def __init__(
        self,
        ctx: EngineContext,
        prepare: Callable[..., Any],
        processes: Processes,
        weights: Weights,
        verbs: AccelerateVerbs,
    ) -> None:
        super().__init__(ctx)
        self._prepare, self._processes, self._weights, self._verbs = prepare, processes, weights, verbs
        self._trigger_raised = False

    # ------------------------------------------------------------------ facts
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.ctx.config.grad_accum_steps

    @property
    def use_distributed(self) -> bool:
        return self.ctx.info.world_size > 1

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's autocast context, for code outside the prepared model's forward."""
        return autocast_context(self.ctx.config.precision, self.ctx.device.type)

    # ------------------------------------------------------------------ one object at a time
    def prepare_model(self, model: Any) -> Any:
        return self._prepare(model)

    def prepare_optimizer(self, optimizer: Any) -> Any:
        return self._prepare(optimizer)

    def prepare_data_loader(self, data_loader: Any) -> Any:
        return self._prepare(data_loader)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self._prepare(scheduler)

    def get_state_dict(self, model: Any = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The prepared model's full weights under the user's names, from any layout (`full_state_dict`)."""
        return self._weights.full_state_dict()

    def clear(self, *objects: Any) -> list[None]:
        return self._verbs.free_memory(*objects)

    # ------------------------------------------------------------------ collectives
    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad every tensor along `dim` to its largest size over the data-parallel ranks (with `pad_index`, at
        the end or with `pad_first` at the start), so that `gather` can concatenate them."""

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            if dim >= tensor.dim() or dist.get_world_size(self.ctx.placement.data_group) == 1:
                return tensor
            size = torch.tensor([tensor.shape[dim]], device=tensor.device)
            dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self.ctx.placement.data_group)
            missing = int(size.item()) - tensor.shape[dim]
            if missing == 0:
                return tensor
            return F.pad(tensor, _pad_widths(tensor.dim(), dim, missing, pad_first), value=pad_index)

        return map_tensors(pad, data)

    # ------------------------------------------------------------------ per-process order
    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Each node's first process runs the block first (a per-node cache), then the node's others."""
        return self._processes.main_process_first(per_node=True)

    def on_local_process(self, function: Any = None, local_process_index: int = 0) -> Any:
        """Decorator: the function runs on each node's process `local_process_index` only."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._verbs.only_where(self.ctx.info.local_rank == local_process_index, function)

    # ------------------------------------------------------------------ a flag any rank may raise
    def set_trigger(self) -> None:
        """Raise a flag on this rank (e.g. its loss went NaN); `check_trigger()` on every rank then sees it."""
        self._trigger_raised = True

    def check_trigger(self) -> bool:
        """True on every rank if any rank called `set_trigger()` since the last check (collective); resets it."""
        flag = torch.tensor([1.0 if self._trigger_raised else 0.0], device=self.ctx.device)
        if self.ctx.info.world_size > 1:
            dist.all_reduce(flag, group=self.ctx.placement.barrier_group)
        self._trigger_raised = False
        return bool(flag.item() > 0)


def _pad_widths(ndim: int, dim: int, missing: int, pad_first: bool) -> list[int]:
    """F.pad's widths (last dim first, two per dim) adding `missing` entries before or after `dim`."""
    widths = [0] * (2 * (ndim - dim))
    widths[-2 if pad_first else -1] = missing
    return widths
