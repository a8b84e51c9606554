"""Which ZeRO stage a run really gets, and the optimizer side of sharding (rebinding, ZeRO-1/2, plain-tensor
optimizers over DTensor shards, NVMe)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.config.layout import Layout
from meshkit.config.schema import RunConfig, ShardingConfig
from meshkit.core.errors import MeshkitError
from meshkit.parallel.zero.local_shards import LocalShardOptimizer, steps_plain_tensors
from meshkit.parallel.zero.nvme import NVMeOptimizer, block_pages
from meshkit.parallel.zero.optimizer import ExpertShards, ZeroOptimizer
from meshkit.runtime.mesh import ParallelMesh


class ShardingError(MeshkitError):
    """A sharding layout that is not supported; the message names the nearest one that is."""


class UnshardedRunWarning(UserWarning):
    """zero_stage asked for, but there is only one data-parallel rank to shard over."""


def effective_zero_stage(cfg: ShardingConfig, layout: Layout) -> int:
    """The stage the run gets on `layout`'s mesh: 0 when a single data-parallel rank holds everything anyway, or when
    a shard group of one rank does (warned either way)."""
    stage = cfg.zero_stage
    if stage == 0:
        return 0
    if layout.dp * layout.cp == 1:
        warnings.warn(
            f"zero_stage={stage} with a single data-parallel rank: nothing to shard, the run goes on unsharded",
            UnshardedRunWarning,
            stacklevel=3,
        )
        return 0
    replicate, shard = layout.dp_replicate, layout.dp_shard * layout.cp
    if stage == 3 and shard == 1:  # (an expert-parallel config's "dp_shard_size: 1": experts split, the rest not)
        warnings.warn(
            f"zero_stage=3 with dp_shard=1 shards nothing (dp_replicate={replicate}): the run goes on replicated, "
            "as DDP (dp_shard=-1 shards over every data-parallel rank)",
            UnshardedRunWarning,
            stacklevel=3,
        )
        return 0
    if stage in (1, 2) and replicate > 1 and shard > 1:
        raise ShardingError(
            f"zero_stage={stage} shards over all data-parallel ranks and has no hybrid form: use zero_stage=3 "
            f"for HSDP (dp_replicate={replicate} × dp_shard={shard}), or set dp_replicate=1"
        )
    return stage


def renamed_parameters(
    originals: list[tuple[str, nn.Parameter]], now: dict[str, nn.Parameter]
) -> dict[int, nn.Parameter | None]:
    """id(original parameter) -> the parameter now under one of its names (None: on another pipeline stage).

    A tied parameter has several names; this stage may hold it under any one of them (the first pipeline
    stage as the embedding, the last as the head)."""
    by_id: dict[int, tuple[nn.Parameter, nn.Parameter | None]] = {}
    for name, param in originals:
        current = now.get(name)
        if current is not None or id(param) not in by_id:
            by_id[id(param)] = (param, current)
    return {key: current for key, (param, current) in by_id.items() if current is not param}


def rebind_params(optimizer: torch.optim.Optimizer, renamed: dict[int, nn.Parameter | None]) -> torch.optim.Optimizer:
    """Point the optimizer at the parameters that sharding put in place of the ones it was built with."""
    if not renamed:
        return optimizer
    if optimizer.state and any(id(p) in renamed for g in optimizer.param_groups for p in g["params"]):
        raise ShardingError("prepare() the optimizer before its first step: its state belongs to unsharded parameters")
    for group in optimizer.param_groups:  # None: the parameter lives on another pipeline stage
        group["params"] = [q for p in group["params"] if (q := renamed.get(id(p), p)) is not None]
    return optimizer


def shard_optimizer(
    optimizer: torch.optim.Optimizer,
    models: list[nn.Module],
    mesh: ParallelMesh,
    config: RunConfig,
    stage: int,
    reduced_elsewhere: set[int] | None = None,
    experts: set[int] | None = None,
) -> torch.optim.Optimizer:
    """ZeRO-1/2 shard the optimizer itself (reducing gradients in `zero`'s buckets during backward, except on
    pipeline stages and for groups holding `reduced_elsewhere` parameters); `offload=nvme` moves its states to
    files (any stage)."""
    cfg, blocks, zero = config.sharding, config.blocks, config.zero
    directory = Path(cfg.offload_dir or ".") / f"rank{mesh.rank}"
    if stage in (1, 2):

        def offload(inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
            pages = [[p for p in group["params"]] for group in inner.param_groups]
            return NVMeOptimizer(inner, directory, pages)

        tp_group = mesh.group("tp") if mesh.size("tp") > 1 else None
        per_micro_step = stage == 2 if zero.reduce_every_micro_step is None else zero.reduce_every_micro_step
        bucket = int(zero.bucket_mb * 1e6)
        overlap = (bucket, per_micro_step, reduced_elsewhere or set()) if mesh.size("pp") == 1 else None
        wrap = offload if cfg.offload == "nvme" else None
        banks = None
        if experts and mesh.dims.ep > 1:  # each rank's own experts: chunked over the ranks holding the same ones
            banks = ExpertShards(frozenset(experts), mesh.expert_dim("edp").get_group(), mesh.grad_size)
        return ZeroOptimizer(optimizer, mesh.grad_group, stage, wrap, tp_group, overlap, banks)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if steps_plain_tensors(optimizer) and any(isinstance(p, DTensor) for p in params):
        optimizer = LocalShardOptimizer(optimizer)  # ZeRO-3 and tp shards, stepped as plain local pieces
    if cfg.offload != "nvme":
        return optimizer
    pages: list[list[nn.Parameter]] = []
    for model in models:
        pages.extend(block_pages(model, params, blocks))
    return NVMeOptimizer(optimizer, directory, pages)
