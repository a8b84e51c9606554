"""`Engine(layout="auto")` in a user's own loop: at `prepare(model, optimizer, loader)` the planner proposes the
layouts that fit this model on this world, each is stepped a few times on a copy of the model with a fresh
optimizer of the same kind on the user's data (`engine.train_step`), and the fastest becomes the engine's
layout before the user's objects are prepared. The global batch stays the one the user's loader gives
(batch_size × data-parallel ranks × grad_accum_steps); the prepared loader yields the chosen layout's
micro-batches (`train.micro_batch_size`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from meshkit.config.layout import Layout
from meshkit.config.resolve import ResolvedConfig
from meshkit.core.tree import to_device
from meshkit.data.loader import endless, rebuilt
from meshkit.engine.prepared_objects import EngineError
from meshkit.models.blocks import block_list, block_units
from meshkit.models.structure import ModelStructure, describe
from meshkit.planning.estimate import ModelShape
from meshkit.planning.hardware import Hardware
from meshkit.planning.layout_probe import Candidate, Workload, choose, print_probe_table, with_values
from meshkit.planning.probe import timed
from meshkit.training.loss import LossFn, compute_loss

AUTO_PENDING = "layout: auto (chosen at prepare)"


def shape_of(model: nn.Module, structure: ModelStructure) -> ModelShape:
    """The planner's view of any model, from the model-structure layer's facts: parameters, blocks (count
    and the largest), hidden size and heads of its attention, vocabulary of its first embedding."""
    params = float(sum(p.numel() for p in model.parameters()))
    blocks = [block for _, block in block_units(block_list(model, structure.blocks))] if structure.blocks else []
    largest = max((float(sum(p.numel() for p in b.parameters())) for b in blocks), default=None)
    attention = structure.attention[0] if structure.attention else None
    heads = attention.heads if attention else None
    hidden = heads * attention.head_dim if attention and heads and attention.head_dim else None
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return ModelShape(
        params=params,
        layers=len(blocks) or None,
        hidden=hidden,
        heads=heads,
        vocab=embedding.num_embeddings if embedding is not None else None,
        largest_layer_params=largest,
        kv_heads=attention.kv_heads if attention else None,
    )


def sequence_length(batch: Any) -> int:
    """The length of the first 2-D tensor of a batch (token ids: [batch, sequence])."""
    found: list[int] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not found:
            found.append(value.shape[1])
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(batch)
    return found[0] if found else 1


def optimizer_step(engine: Any, batches: Iterator[Any]) -> Callable[[], None]:
    """A probe's step: `train_step` on the next batches until the gradients sync (one optimizer step)."""

    def step() -> None:
        engine.train_step(next(batches))
        while not engine.sync_gradients:
            engine.train_step(next(batches))

    return step


def rebatched(loader: DataLoader, batch_size: int) -> DataLoader:
    """`loader` yielding `batch_size` samples per batch, every other setting kept."""
    if loader.batch_size == batch_size:
        return loader
    shuffle = isinstance(loader.sampler, torch.utils.data.RandomSampler)
    return rebuilt(loader, batch_size=batch_size, shuffle=shuffle, drop_last=loader.drop_last)


def same_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, copy_of: nn.Module) -> torch.optim.Optimizer:
    """A fresh optimizer of `optimizer`'s class and groups over the same-named parameters of `copy_of`."""
    names = {id(p): name for name, p in model.named_parameters()}
    twins = dict(copy_of.named_parameters())
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [twins[names[id(p)]] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    accepted = inspect.signature(type(optimizer).__init__).parameters  # defaults may hold more than it takes
    try:
        return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    except TypeError as err:
        raise EngineError(
            f"layout: auto makes a fresh {type(optimizer).__name__} per probed layout and could not ({err}): "
            "pick a layout with meshkit plan instead"
        ) from None


def _efficiency(model: nn.Module, batch: Any, loss_fn: LossFn | None, device: torch.device) -> Callable:
    """A profile refinement: what one forward + backward of (a copy of) the whole model reaches of the
    measured matmul rate, its FLOPs counted by torch (every rank at once)."""

    def refine(hardware: Hardware) -> Hardware:
        twin = copy.deepcopy(model).to(device)
        moved = to_device(batch, device)

        def step() -> None:
            compute_loss(twin, moved, loss_fn).backward()

        with FlopCounterMode(display=False) as counter:
            step()
        seconds = timed(step, device, calls=3)
        flops = counter.get_total_flops()
        return replace(hardware, matmul_efficiency=min(1.0, flops / seconds / (hardware.peak_tflops * 1e12)))

    return refine


def choose_for_loop(
    engine: Any, objects: tuple[Any, ...], loss_fn: LossFn | None, engine_class: Any
) -> tuple[ResolvedConfig, list[Candidate]]:
    """Probe the layouts for `objects` (one model, one optimizer, one DataLoader) and return the chosen config."""
    models = [o for o in objects if isinstance(o, nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    loaders = [o for o in objects if isinstance(o, DataLoader)]
    micro_batch = loaders[0].batch_size if len(loaders) == 1 else None
    if len(models) != 1 or len(optimizers) != 1 or micro_batch is None:
        raise EngineError(
            "layout: auto probes the layouts at prepare(): pass the model, its optimizer and the training "
            "DataLoader (with batch_size=) to one prepare() call"
        )
    model, optimizer, loader = models[0], optimizers[0], loaders[0]
    resolved: ResolvedConfig = engine.resolved
    config = resolved.config
    dims = Layout.from_config(config.parallel, engine.info.world_size)
    batch = next(iter(loader))
    structure = describe(model, config.blocks, config.structure)
    fused = config.fused_loss != "off" and loss_fn is None and structure.causal_lm  # (what train_step will do)
    workload = Workload(
        shape_of(model, structure),
        seq_len=sequence_length(batch),
        global_batch=micro_batch * dims.dp_replicate * dims.dp_shard * config.grad_accum_steps,
        micro_batch=micro_batch,
        refine=_efficiency(model, batch, loss_fn, engine.device),
        loss="fused" if fused else "plain",
    )

    def build(probe: Any) -> Callable[[], None]:
        twin = copy.deepcopy(model)
        prepared = probe.prepare(
            twin,
            same_optimizer(optimizer, model, twin),
            rebatched(loader, probe.config.train.micro_batch_size),
            loss_fn=loss_fn,
        )
        return optimizer_step(probe, endless(prepared[2]))

    auto = with_values(resolved, {"layout": "auto"}, AUTO_PENDING)
    return choose(auto, build, engine_class, workload)


def settle_layout(
    engine: Any, objects: tuple[Any, ...], loss_fn: LossFn | None
) -> tuple[ResolvedConfig, list[Candidate], tuple[Any, ...]]:
    """Choose the engine's layout by probing (`layout: auto`) and print the table; returns the chosen config, every
    candidate probed, and `objects` with the loader re-batched to the chosen micro-batch (the engine lays itself
    out in the chosen config)."""
    chosen, probed = choose_for_loop(engine, objects, loss_fn, type(engine))
    if engine.is_main_process:
        print_probe_table(probed)
    size = chosen.config.train.largest_micro_batch  # (a chosen layout's one size)
    return chosen, probed, tuple(rebatched(o, size) if isinstance(o, DataLoader) else o for o in objects)
