"""Who serves and who works, checked once against the run's config and world."""

from __future__ import annotations

from dataclasses import dataclass

from meshkit.config.schema import RunConfig
from meshkit.core.errors import MeshkitError


class ParameterServerError(MeshkitError):
    """The parameter-server run cannot go on (bad setting, dead server, dead worker in sync mode)."""


@dataclass(frozen=True)
class Roles:
    """Ranks `0..servers-1` serve, the rest work."""

    servers: int
    world_size: int
    rank: int

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.servers))

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.servers, self.world_size))

    @property
    def is_server(self) -> bool:
        return self.rank < self.servers

    @property
    def worker_index(self) -> int | None:
        """This worker's index among the workers (its data shard), None on a server."""
        return None if self.is_server else self.rank - self.servers

    @property
    def num_workers(self) -> int:
        return self.world_size - self.servers


def check_parameter_server(config: RunConfig, world_size: int, rank: int) -> Roles:
    """The roles, or one line naming the setting that does not fit a parameter-server run."""
    ps = config.ps
    if world_size <= ps.servers:
        raise ParameterServerError(
            f"strategy=parameter_server with ps.servers={ps.servers} leaves no worker in a world of {world_size}: "
            f"launch more processes (at least {ps.servers + 1}) or lower ps.servers"
        )
    parallel = config.parallel
    split = {name: getattr(parallel, name) for name in ("tp", "pp", "cp") if getattr(parallel, name) != 1}
    if split or parallel.dp_shard != 1 or config.sharding.zero_stage:
        named = ", ".join(f"{k}={v}" for k, v in split.items()) or f"zero_stage={config.sharding.zero_stage}"
        raise ParameterServerError(
            f"strategy=parameter_server is data parallel through the servers and does not combine with {named}: "
            "set tp, pp, cp to 1 and zero_stage to 0 (or drop strategy for the sharded and split layouts)"
        )
    return Roles(ps.servers, world_size, rank)
