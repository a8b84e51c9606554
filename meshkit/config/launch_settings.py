"""How the workers are started: `launch.*` (torch's elastic agent on each node, or a Ray cluster)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from meshkit.config.section import Section, seconds


class LaunchSettings(Section):
    """How `meshkit launch` starts the workers: torch's elastic agent on each node, or a Ray cluster."""

    backend: Literal["elastic", "ray"] = Field(
        "elastic", description="elastic: one launcher per node (torch's elastic agent); ray: workers on a Ray cluster"
    )
    ray_address: str | None = Field(
        None, description="backend ray: the cluster (auto, ray://host:10001, host:6379); null = a local one for the run"
    )
    ray_num_workers: int | None = Field(
        None, ge=1, description="backend ray: ranks in the job; null = nproc_per_node × nnodes"
    )
    ray_cpus_per_worker: float = Field(1.0, gt=0, description="backend ray: CPUs Ray reserves for each rank")
    ray_gpus_per_worker: float | None = Field(
        None, ge=0, description="backend ray: GPUs for each rank; null = 1 when the device is cuda, else 0"
    )
    ray_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="backend ray: placement-group strategy (PACK fills a node before the next)"
    )
    nproc_per_node: int = Field(1, ge=1, description="worker processes per node")
    nnodes: int = Field(1, ge=1, description="number of nodes (elastic: the most nodes)")
    min_nnodes: int | None = Field(
        None, ge=1, description="elastic: the fewest nodes the job goes on with (`--nnodes MIN:MAX`); null = nnodes"
    )
    node_rank: int = Field(0, ge=0, description="this node's rank (0 hosts the rendezvous)")
    master_addr: str = Field("127.0.0.1", description="address of node 0")
    master_port: int | None = Field(
        None, ge=0, le=65535, description="rendezvous port; null = a free port on one node, 29500 on several"
    )
    max_restarts: int = Field(0, ge=0, description="restart all workers this many times after a failure")
    rdzv_timeout_s: float = seconds(300.0, "seconds to wait for every node to join")
    rdzv_last_call_s: float = seconds(
        30.0, "elastic: once min_nnodes have joined, seconds to wait for more before starting"
    )
    local_addr: str | None = Field(
        None,
        description="address this node binds its stores to and advertises; null = 127.0.0.1 on one node, "
        "else this host's address on the route to master_addr",
    )
    bind_all_interfaces: bool = Field(
        False, description="bind the (unauthenticated) stores to every interface: only on a trusted network"
    )
    stop_grace_s: float = seconds(
        5.0, "after a rank fails or hangs, seconds the others get to exit before they are killed (SIGKILL)"
    )
    shutdown_grace_s: float = seconds(
        30.0, "after the preemption signal, seconds the workers get to checkpoint and exit before SIGKILL"
    )

    @property
    def world_size(self) -> int:
        """Ranks in the job (its most, for an elastic one)."""
        if self.backend == "ray" and self.ray_num_workers is not None:
            return self.ray_num_workers
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _node_rank_in_range(self) -> LaunchSettings:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        if self.min_nnodes is not None and self.min_nnodes > self.nnodes:
            raise ValueError(f"min_nnodes={self.min_nnodes} must not exceed nnodes={self.nnodes} (--nnodes MIN:MAX)")
        return self
