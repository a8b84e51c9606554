"""How the engine prepares a DataLoader: sharded over the data-parallel ranks, with per-rank sizes when the batch
is uneven, or the loader the placement gives instead (a parameter server's empty one)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from meshkit.data.loader import shard_dataloader
from meshkit.data.uneven import node_rank, per_rank_sizes
from meshkit.engine.context import EngineContext


def prepare_loader(ctx: EngineContext, loader: DataLoader) -> Any:
    """This rank's share of `loader`; under per-rank batch sizes it records (its samples, all ranks') in
    `ctx.objects.uneven`, so that backward weighs each rank's gradient by its samples."""
    placement = ctx.placement
    own = placement.own_loader(loader)
    if own is not None:
        return own
    sizes = None
    if ctx.config.train.uneven:
        node = node_rank(ctx.info.rank, ctx.info.local_world_size)
        split = {"pp": ctx.mesh.size("pp"), "cp": ctx.mesh.size("cp")}
        sizes = per_rank_sizes(ctx.config.train.micro_batch_size, placement.dp_size, placement.data_group, node, split)
        mine = sizes[placement.dp_rank]
        ctx.objects.uneven = (mine, sum(sizes) if placement.shares_gradients else mine)  # (else: who averages weighs)
    return shard_dataloader(
        loader,
        dp_rank=placement.dp_rank,
        dp_size=placement.dp_size,
        seed=ctx.config.seed,
        device=ctx.device,
        state=ctx.gradient_state,
        sizes=sizes,
    )
