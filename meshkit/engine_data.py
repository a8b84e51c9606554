"""How the engine prepares a DataLoader (a mixin of `Engine`): sharded over the data-parallel ranks, with
per-rank sizes when the batch is uneven, or an empty loader on a parameter server."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from meshkit.data.loader import ShardedLoader, shard_dataloader
from meshkit.data.uneven import node_rank, per_rank_sizes
from meshkit.paramserver.run import EmptyLoader


class DataMixin:
    """Uses the engine's `config`, `info`, `mesh`, `device`, `gradient_state`, `dp_rank`, `dp_size` and groups."""

    config: Any
    info: Any
    mesh: Any
    device: Any
    gradient_state: Any
    dp_rank: int
    dp_size: int
    _ps: Any
    _data_group: Any
    _uneven: tuple[int, int] | None

    def _prepare_loader(self, loader: DataLoader) -> ShardedLoader:
        if self._ps is not None and self._ps.is_server:
            return EmptyLoader(loader)  # type: ignore[return-value]
        sizes = None
        if self.config.train.uneven:  # per-rank sizes: each rank's gradient counts its samples (backward)
            node = node_rank(self.info.rank, self.info.local_world_size)
            split = {"pp": self.mesh.size("pp"), "cp": self.mesh.size("cp")}
            sizes = per_rank_sizes(self.config.train.micro_batch_size, self.dp_size, self._data_group, node, split)
            mine = sizes[self.dp_rank]
            self._uneven = (mine, mine if self._ps else sum(sizes))  # the servers weigh the workers themselves
        return shard_dataloader(
            loader,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            seed=self.config.seed,
            device=self.device,
            state=self.gradient_state,
            sizes=sizes,
        )
