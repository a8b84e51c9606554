"""Gradient synchronisation: when gradients are reduced, how the loss is scaled, and the global norm.

One `GradientSync` per engine. It works on the engine's own lists of prepared models and optimizers, so every
layout takes the same path: DDP reduces during backward (and skips that under `no_sync`), FSDP reduce-scatters
during backward (switched off with `set_requires_gradient_sync`), ZeRO-1/2 reduce in buckets during the backward
that ends a window (stage 2: or every micro-step, `zero.reduce_every_micro_step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.core.errors import MeshkitError
from meshkit.parallel.zero.optimizer import ZeroOptimizer
from meshkit.runtime import collectives
from meshkit.training.accumulation import GradientState, PreparedOptimizer
from meshkit.training.precision import unscale_once

if TYPE_CHECKING:
    from meshkit.engine.context import EngineContext


class GradientError(MeshkitError):
    """Wrong use of backward or accumulation; the message says what to pass."""


class GradientReducer(Protocol):
    """Reduces gradients itself, after the last backward of a window (ZeRO-1/2, DTensor data parallel)."""

    def before_backward(self) -> None: ...

    def reduce_gradients(self) -> None: ...


class GradientSync:
    def __init__(
        self,
        state: GradientState,
        scaler: torch.amp.GradScaler | None,
        grad_group: dist.ProcessGroup,
        models: list[nn.Module],
        optimizers: list[PreparedOptimizer],
        loss_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.pp_group = pp_group
        # ids of parameters whose gradient a clip norm counts elsewhere (a tied copy on a later pipeline stage)
        self.counted_elsewhere: set[int] = set()
        self.loss_context = loss_context  # loss parallel: backward through vocab-sharded logits needs it
        self.state = state
        self.scaler = scaler
        self.grad_group = grad_group
        self.grad_size = dist.get_world_size(grad_group)
        self.models = models  # the engine's lists: prepared objects appear here as they are prepared
        self.optimizers = optimizers
        self.model_reducers: list[GradientReducer] = []  # for models no DDP/FSDP wrapper reduces
        self._parameters: tuple[tuple[int, ...], list[nn.Parameter]] = ((), [])  # (ids of models, their params)
        self.left_out: frozenset[int] = frozenset()  # ids of parameters the optimizer steps leave as they are

    def leave_out(self, parameters: list[nn.Parameter]) -> None:
        """The coming optimizer steps leave `parameters` as they are, as if frozen: their gradients are dropped
        once a window's backward completes them, before any clip norm or step (the optimizer skips a parameter
        without one)."""
        if parameters and self.zero_optimizers:
            raise GradientError(
                "leaving parameters out of a step needs an optimizer state per parameter; ZeRO-1/2 step flat "
                "chunks: use zero_stage 0 or 3"
            )
        self.left_out = frozenset(map(id, parameters))

    def parameters(self) -> list[nn.Parameter]:
        """Every prepared model's parameters, listed once per set of models (walking the modules each step
        costs as much as a small all-reduce)."""
        key = tuple(map(id, self.models))
        if self._parameters[0] != key:
            self._parameters = (key, [p for model in self.models for p in model.parameters()])
        return self._parameters[1]

    def reduced_by_models(self) -> set[int]:
        """Ids of parameters a model reducer finishes after backward (e.g. summed over tp first)."""
        return {id(p) for reducer in self.model_reducers for p in getattr(reducer, "params", ())}

    @property
    def zero_optimizers(self) -> list[ZeroOptimizer]:
        return [opt.optimizer for opt in self.optimizers if isinstance(opt.optimizer, ZeroOptimizer)]

    @property
    def reducers(self) -> list[GradientReducer]:
        return [*self.model_reducers, *self.zero_optimizers]

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        self.state.begin_micro_step()
        sync = self.state.sync
        with contextlib.ExitStack() as stack:
            for model in self.models:
                wrapper: Any = model  # FSDP2's or DDP's own methods
                if hasattr(wrapper, "set_requires_gradient_sync"):  # FSDP: reduce-scatter only when syncing
                    wrapper.set_requires_gradient_sync(sync)
                elif not sync and hasattr(wrapper, "no_sync") and not getattr(wrapper, "static_graph", False):  # DDP
                    # (under a static graph no_sync trips an internal assert in torch's reducer, or with it
                    # fixed silently stops reducing: pytorch#143580, #187732. Reducing every micro-step gives
                    # the same sums, as the gradients already reduced are equal on every rank.)
                    stack.enter_context(wrapper.no_sync())
            yield

    def backward(
        self,
        loss: torch.Tensor,
        num_items: float | torch.Tensor | None,
        global_items: Callable[[], float] | None = None,
        **backward_options: Any,
    ) -> None:
        """`global_items`: gives this micro-step's item count summed over the gradient group, computed by the
        caller while backward ran (train_step); without it the window's count is all-reduced when it ends.
        `backward_options` go to torch's `backward` (retain_graph, inputs, ...)."""
        state = self.state
        weighted = num_items is not None
        if state.weighted_window is None:
            state.weighted_window = weighted
        elif state.weighted_window != weighted:
            raise GradientError("backward(): pass num_items on every micro-step of an accumulation window, or on none")
        if num_items is not None:
            state.window_items += float(num_items)
            loss = loss * float(num_items)
        else:
            loss = loss / state.accum_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        zero = self.zero_optimizers
        for reducer in self.model_reducers:
            reducer.before_backward()
        for optimizer in zero:  # ZeRO-1/2 reduce in buckets during the backward that ends a window (or each)
            optimizer.before_backward(final=state.sync)
        with self.loss_context():
            loss.backward(**backward_options)
        for optimizer in zero:
            optimizer.after_backward()
        if weighted:
            so_far = state.window_global_items
            state.window_global_items = (
                so_far + global_items() if so_far is not None and global_items is not None else None
            )
        if state.sync:
            factor = self._items_factor(state.window_items, state.window_global_items, loss.device) if weighted else 1.0
            if factor != 1.0:
                self._scale_gradients(factor)
            for reducer in self.reducers:
                reducer.reduce_gradients()
            for optimizer in zero:  # gradients reduced during backward that no parameter's .grad above views
                if factor != 1.0:
                    optimizer.scale_reduced(factor)
            self._drop_left_out()
            state.end_window()

    def _items_factor(self, local_items: float, global_items: float | None, device: torch.device) -> float:
        """What the window's gradients are multiplied by so they average over every rank's items."""
        if global_items is None:
            global_items = collectives.reduce(torch.tensor(local_items, device=device), self.grad_group, op="sum")
            global_items = float(global_items)
        if global_items <= 0:
            raise GradientError(
                "backward(): num_items summed to 0 over the window; pass the count of items in the loss"
            )
        return self.grad_size / global_items  # the gradient average divides by the group size already

    def _scale_gradients(self, factor: float) -> None:
        # one call per kind of tensor, not one kernel per parameter (foreach ops take no mixed DTensor/Tensor lists)
        kinds: dict[Any, list[torch.Tensor]] = {}
        for param in self.parameters():
            grad = param.grad
            if grad is not None:
                kind = (id(grad.device_mesh), grad.placements) if isinstance(grad, DTensor) else grad.device
                kinds.setdefault(kind, []).append(grad)
        for grads in kinds.values():
            torch._foreach_mul_(grads, factor)

    def reduce_after_schedule(self) -> None:
        """A pipeline schedule ran the backward passes itself: reduce what no wrapper reduced."""
        for reducer in self.reducers:
            reducer.reduce_gradients()
        self._drop_left_out()
        self.state.end_window()

    def _drop_left_out(self) -> None:
        """The window's gradients are complete: those of the parameters left out go (`leave_out`)."""
        if self.left_out:
            for param in self.parameters():
                if id(param) in self.left_out:
                    param.grad = None

    def unscale_gradients(self, optimizers: list[PreparedOptimizer] | None = None) -> None:
        """Under fp16, divide the gradients by the loss scale now (once per step; clipping calls it too)."""
        if self.scaler is None:
            return
        for optimizer in self.optimizers if optimizers is None else optimizers:
            unscale_once(self.scaler, optimizer.optimizer)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value], after the window's reduction (elementwise,
        so ZeRO's chunks and FSDP's shards clamp as they are)."""
        if not self.state.sync:
            return
        self.unscale_gradients()
        zero = self.zero_optimizers
        if zero:
            for optimizer in zero:
                optimizer.clip_grad_value_(clip_value)
            return
        for param in self.parameters():
            if param.grad is not None:
                param.grad.clamp_(-clip_value, clip_value)

    def step(self, optimizer: Any, schedulers: list[Any], max_grad_norm: float | None) -> None:
        """The end of a micro-step: clip (on syncing micro-steps), step the optimizer and the schedulers (they
        act on syncing micro-steps only), clear the gradients."""
        if self.state.sync and max_grad_norm is not None:
            self.clip_grad_norm_(max_grad_norm, 2.0)
        optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        optimizer.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor | None:
        if not self.state.sync:
            return None
        self.unscale_gradients()
        zero = self.zero_optimizers
        if zero:  # gradients live in per-rank chunks: the norm needs one all-reduce
            return zero[0].clip_grad_norm_(max_norm, norm_type)
        held = [(id(p), p.grad) for p in self.parameters() if p.grad is not None]
        grads = [grad for _, grad in held]
        norm = total_norm([grad for key, grad in held if key not in self.counted_elsewhere], norm_type)
        if self.pp_group is not None:  # every pipeline stage holds other parameters: combine their norms
            norm = norm.float()
            if norm_type == float("inf"):
                dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self.pp_group)
            else:
                norm = norm**norm_type
                dist.all_reduce(norm, group=self.pp_group)
                norm = norm ** (1.0 / norm_type)
        coefficient = min(1.0, max_norm / (float(norm) + 1e-6))
        if coefficient < 1.0:
            for grad in grads:
                grad.mul_(coefficient)
        return norm


def gradient_sync(ctx: EngineContext) -> GradientSync:
    """The engine's gradient sync for its layout (made again when `layout: auto` settles)."""
    return GradientSync(
        ctx.gradient_state,
        ctx.scaler,
        ctx.placement.grad_group,
        ctx.objects.models,
        ctx.objects.optimizers,
        ctx.loss_parallel,
        ctx.mesh.group("pp") if ctx.mesh.size("pp") > 1 else None,
    )


def clip_arguments(args: tuple[Any, ...], norm_type: float) -> tuple[float, float]:
    """(max_norm, norm_type) from `clip_grad_norm_(max_norm[, norm_type])` or Accelerate's
    `clip_grad_norm_(parameters, max_norm[, norm_type])` (the parameters are every prepared model's either way)."""
    if args and not isinstance(args[0], (int, float)):
        args = args[1:]
    if not 1 <= len(args) <= 2 or not all(isinstance(a, (int, float)) for a in args):
        raise TypeError("clip_grad_norm_ takes (max_norm[, norm_type]) or (parameters, max_norm[, norm_type])")
    return float(args[0]), float(args[1]) if len(args) == 2 else norm_type


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm over every gradient. DTensor gradients (sharded by FSDP, split by TP) reduce their parts; plain
    ones (e.g. norms left whole under tensor parallel) are the same on every rank. Plain tensors and the DTensors
    of each mesh cannot share one foreach call, so each kind gets its own and the results are combined."""
    kinds: dict[Any, list[torch.Tensor]] = {}  # plain tensors, and DTensors by mesh (expert banks have their own)
    for grad in grads:
        kinds.setdefault(id(grad.device_mesh) if isinstance(grad, DTensor) else None, []).append(grad)
    parts = []
    for kind in kinds.values():
        if kind:
            norm: Any = nn.utils.get_total_norm(kind, norm_type)
            parts.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    if not parts:
        return torch.zeros(())
    if norm_type == float("inf"):
        return torch.stack(parts).max()
    return torch.stack([part**norm_type for part in parts]).sum() ** (1.0 / norm_type)
