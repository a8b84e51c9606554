"""How the engine prepares a DataLoader: sharded over the data-parallel ranks, with per-rank sizes when the batch
is uneven, or an empty loader on a parameter server."""

from __future__ import annotations

from torch.utils.data import DataLoader

from meshkit.data.loader import ShardedLoader, shard_dataloader
from meshkit.data.uneven import node_rank, per_rank_sizes
from meshkit.engine.context import EngineContext
from meshkit.paramserver.run import EmptyLoader


def prepare_loader(ctx: EngineContext, loader: DataLoader) -> ShardedLoader | EmptyLoader:
    """This rank's share of `loader`; under per-rank batch sizes it records (its samples, all ranks') in
    `ctx.objects.uneven`, so that backward weighs each rank's gradient by its samples."""
    placement = ctx.placement
    if placement.ps is not None and placement.ps.is_server:
        return EmptyLoader(loader)
    sizes = None
    if ctx.config.train.uneven:
        node = node_rank(ctx.info.rank, ctx.info.local_world_size)
        split = {"pp": ctx.mesh.size("pp"), "cp": ctx.mesh.size("cp")}
        sizes = per_rank_sizes(ctx.config.train.micro_batch_size, placement.dp_size, placement.data_group, node, split)
        mine = sizes[placement.dp_rank]
        ctx.objects.uneven = (mine, mine if placement.ps else sum(sizes))  # the servers weigh the workers themselves
    return shard_dataloader(
        loader,
        dp_rank=placement.dp_rank,
        dp_size=placement.dp_size,
        seed=ctx.config.seed,
        device=ctx.device,
        state=ctx.gradient_state,
        sizes=sizes,
    )
