"""More of Accelerate's verbs on `Engine` (a mixin of `Engine`), for loops written against `Accelerator`:
the `prepare_*` forms, `get_state_dict`, `pad_across_processes`, `local_main_process_first`, `on_local_process`,
`set_trigger` / `check_trigger`, `clear`, `gradient_accumulation_steps`, `use_distributed`, `autocast`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshkit.precision import autocast_context
from meshkit.tree import map_tensors


class AccelerateLoopVerbs:
    """Uses the engine's `info`, `config`, `device`, `prepare`, `full_state_dict`, `free_memory`,
    `wait_for_everyone`, `is_worker` and process groups."""

    info: Any
    config: Any
    device: torch.device
    _data_group: Any
    _barrier_group: Any

    # ------------------------------------------------------------------ facts
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.grad_accum_steps

    @property
    def use_distributed(self) -> bool:
        return self.info.world_size > 1

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's autocast context, for code outside the prepared model's forward."""
        return autocast_context(self.config.precision, self.device.type)

    # ------------------------------------------------------------------ one object at a time
    def prepare_model(self, model: Any) -> Any:
        return self.prepare(model)  # type: ignore[attr-defined]

    def prepare_optimizer(self, optimizer: Any) -> Any:
        return self.prepare(optimizer)  # type: ignore[attr-defined]

    def prepare_data_loader(self, data_loader: Any) -> Any:
        return self.prepare(data_loader)  # type: ignore[attr-defined]

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)  # type: ignore[attr-defined]

    def get_state_dict(self, model: Any = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The prepared model's full weights under the user's names, from any layout (`full_state_dict`)."""
        return self.full_state_dict()  # type: ignore[attr-defined]

    def clear(self, *objects: Any) -> list[None]:
        return self.free_memory(*objects)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ collectives
    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad every tensor along `dim` to its largest size over the data-parallel ranks (with `pad_index`, at
        the end or with `pad_first` at the start), so that `gather` can concatenate them."""

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            if dim >= tensor.dim() or dist.get_world_size(self._data_group) == 1:
                return tensor
            size = torch.tensor([tensor.shape[dim]], device=tensor.device)
            dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self._data_group)
            missing = int(size.item()) - tensor.shape[dim]
            if missing == 0:
                return tensor
            return F.pad(tensor, _pad_widths(tensor.dim(), dim, missing, pad_first), value=pad_index)

        return map_tensors(pad, data)

    # ------------------------------------------------------------------ per-process order
    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Each node's first process runs the block first (a per-node cache), then the node's others."""
        local_main = self.info.local_rank == 0
        if not local_main:
            self.wait_for_everyone()  # type: ignore[attr-defined]
        yield
        if local_main:
            self.wait_for_everyone()  # type: ignore[attr-defined]

    def on_local_process(self, function: Any = None, local_process_index: int = 0) -> Any:
        """Decorator: the function runs on each node's process `local_process_index` only."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_where(self.info.local_rank == local_process_index, function)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ a flag any rank may raise
    def set_trigger(self) -> None:
        """Raise a flag on this rank (e.g. its loss went NaN); `check_trigger()` on every rank then sees it."""
        self._trigger_raised = True

    def check_trigger(self) -> bool:
        """True on every rank if any rank called `set_trigger()` since the last check (collective); resets it."""
        flag = torch.tensor([1.0 if getattr(self, "_trigger_raised", False) else 0.0], device=self.device)
        if self.info.world_size > 1:
            dist.all_reduce(flag, group=self._barrier_group)
        self._trigger_raised = False
        return bool(flag.item() > 0)


def _pad_widths(ndim: int, dim: int, missing: int, pad_first: bool) -> list[int]:
    """F.pad's widths (last dim first, two per dim) adding `missing` entries before or after `dim`."""
    widths = [0] * (2 * (ndim - dim))
    widths[-2 if pad_first else -1] = missing
    return widths
