"""The one source of rank and group truth: parallel sizes, the device mesh, device and backend.

The sizes come resolved and validated as a `Layout` (`config/layout.py`, the one layout type).
`ParallelMesh` builds the single DeviceMesh with named dims in the fixed order (pp, dp_replicate, dp_shard,
cp, tp) and answers every rank question ("my dp rank?", "am I the last pipeline stage?"). Under expert
parallel a second mesh (pp, edp, ep, tp) numbers the same ranks with dp × cp split into edp × ep.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshkit.config.layout import Layout, MeshError
from meshkit.config.schema import PARALLEL_DIMS


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits, as the launcher (meshkit launch, torchrun) told it; world 1 otherwise."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launched: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProcessInfo:
        env = os.environ if env is None else env
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return cls()
        world = int(env["WORLD_SIZE"])
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            world_size=world,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            launched=True,
        )


def select_device(choice: str, local_rank: int) -> torch.device:
    """`auto`: this rank's CUDA device when there is one, else the CPU."""
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise MeshError("device=cuda was asked for, but torch sees no CUDA device: use device=auto or cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise MeshError(f"local rank {local_rank} has no GPU (this node has {count}): use --nproc-per-node {count}")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors (gloo kept for CPU-side objects), gloo on the CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def start_process_group(info: ProcessInfo, device: torch.device, timeout_s: float) -> bool:
    """Join (or, for a plain single process, create) the default process group. True if we created it."""
    if dist.is_initialized():
        if dist.get_world_size() != info.world_size:
            raise MeshError(
                f"a process group of {dist.get_world_size()} ranks already exists, but the launcher "
                f"says the world is {info.world_size}"
            )
        return False
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if info.launched:
        dist.init_process_group(backend_for(device), timeout=timeout, init_method="env://")
    else:
        # A plain `python train.py`: a world of one, so every code path (mesh, collectives) is the same.
        store = dist.HashStore()
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=1, timeout=timeout)
    return True


def stop_process_group(wait_for_peers: bool) -> None:
    """Leave the default process group. With `wait_for_peers`, first wait until every rank is here: a rank that
    leaves while a peer still reads its last collective closes that peer's connection under it (gloo: "Connection
    closed by peer"). An error path leaves at once (a peer may never arrive)."""
    if not dist.is_initialized():
        return
    if wait_for_peers and dist.get_world_size() > 1:
        dist.barrier()
    gc.collect()  # drop finished work handles (and their tensors) before the communicator goes
    dist.destroy_process_group()


class ParallelMesh:
    """The one DeviceMesh of the run, with named sub-meshes and this rank's coordinates."""

    def __init__(self, dims: Layout, info: ProcessInfo, device: torch.device) -> None:
        if dims.world_size != info.world_size:
            raise MeshError(f"layout {dims.describe()} needs {dims.world_size} ranks, the world has {info.world_size}")
        self.dims = dims
        self.info = info
        self.device = device
        self.device_mesh: DeviceMesh = init_device_mesh(device.type, dims.shape, mesh_dim_names=PARALLEL_DIMS)
        # Data-parallel ranks (replicas and shards together) see different data; torch has no public
        # flatten yet, so use the private one torch's own parallel libraries use.
        self.dp_mesh: DeviceMesh = self.device_mesh["dp_replicate", "dp_shard"]._flatten("dp")
        # Context-parallel ranks hold other tokens of the same samples: gradients are averaged over dp × cp,
        # and FSDP shards over dp_shard × cp.
        self.grad_mesh: DeviceMesh = self.device_mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        # FSDP's mesh, kept here: torch deprecates slicing a flattened dimension back out of the root mesh.
        shard_cp = self.device_mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        replicas = dims.dp_replicate
        self.fsdp_mesh: DeviceMesh = (
            self.grad_mesh._unflatten(0, (replicas, self.grad_mesh.size() // replicas), ("dp_replicate", "dp_shard_cp"))
            if replicas > 1
            else shard_cp
        )
        self._flattened: dict[tuple[str, ...], DeviceMesh] = {}
        self.expert_mesh: DeviceMesh | None = None
        if dims.ep > 1:
            # Expert parallel splits the dp × cp ranks (flattened in mesh order) into edp groups of ep ranks that
            # share out the experts; ranks number the same as in the main mesh. A root mesh of its own, so that
            # FSDP over edp and the experts' DTensors over ep share one parent, as FSDP requires.
            tokens = self.grad_mesh.size()
            shape = (dims.pp, tokens // dims.ep, dims.ep, dims.tp)
            self.expert_mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "edp", "ep", "tp"))

    # ranks of the whole world
    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.info.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.info.local_rank == 0

    # named dimensions
    def size(self, dim: str) -> int:
        return getattr(self.dims, dim)

    def coordinate(self, dim: str) -> int:
        """This rank's index along `dim` (one of pp, dp_replicate, dp_shard, cp, tp)."""
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(dim)

    def flat_group(self, dims: tuple[str, ...]) -> dist.ProcessGroup | None:
        """The ranks that differ only along `dims` (in mesh order), as one group; None when that is this rank
        alone. The first call for some `dims` creates the group: every rank makes it at the same point."""
        dims = tuple(dim for dim in PARALLEL_DIMS if dim in dims and self.size(dim) > 1)
        if not dims:
            return None
        if len(dims) == 1:
            return self.group(dims[0])
        if dims not in self._flattened:
            self._flattened[dims] = self.device_mesh[dims]._flatten("_".join(dims))
        return self._flattened[dims].get_group()

    # data parallel (replicas and shards together)
    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    # gradient averaging: dp × cp
    @property
    def grad_size(self) -> int:
        return self.dims.dp * self.dims.cp

    @property
    def grad_group(self) -> dist.ProcessGroup:
        return self.grad_mesh.get_group()

    # expert parallel
    def expert_dim(self, dim: str) -> DeviceMesh:
        """`ep` (the ranks that split the experts) or `edp` (the ranks that hold the same experts)."""
        if self.expert_mesh is None:
            raise MeshError("expert parallel is off (parallel.ep=1): there is no expert mesh")
        return self.expert_mesh[dim]

    # pipeline
    @property
    def is_first_stage(self) -> bool:
        return self.coordinate("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coordinate("pp") == self.dims.pp - 1
