"""Threads per rank and NUMA binding for the ranks of one node.

On a host with several NUMA nodes, local ranks are spread over the nodes in contiguous groups and each rank
is bound to its node's cores, so its memory stays local. On a single-node host this is a no-op. The thread
count defaults to the rank's share of the cores it may run on, so ranks never oversubscribe the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

NUMA_SYSFS = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> frozenset[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def numa_nodes(root: Path = NUMA_SYSFS) -> list[frozenset[int]]:
    """CPUs of each NUMA node that has any (empty list where the kernel exposes no NUMA information)."""
    nodes = []
    for node in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpulist = node / "cpulist"
        if cpulist.is_file():
            cpus = parse_cpulist(cpulist.read_text())
            if cpus:
                nodes.append(cpus)
    return nodes


def node_for_local_rank(local_rank: int, local_world_size: int, n_nodes: int) -> int:
    """Contiguous groups: with 8 ranks on 2 nodes, ranks 0-3 go to node 0 and 4-7 to node 1."""
    return local_rank * n_nodes // local_world_size


@dataclass(frozen=True)
class Affinity:
    threads: int
    cpus: frozenset[int]
    numa_node: int | None  # None: not bound (one NUMA node, or binding not possible)


def plan_affinity(
    local_rank: int,
    local_world_size: int,
    nodes: list[frozenset[int]],
    available: frozenset[int],
    threads: int | None = None,
) -> Affinity:
    """Decide this rank's CPUs and thread count without touching the process."""
    if len(nodes) > 1:
        node = node_for_local_rank(local_rank, local_world_size, len(nodes))
        cpus = nodes[node] & available or available
        sharing = sum(
            1 for r in range(local_world_size) if node_for_local_rank(r, local_world_size, len(nodes)) == node
        )
        bound: int | None = node
    else:
        cpus, sharing, bound = available, local_world_size, None
    return Affinity(threads=threads or max(1, len(cpus) // sharing), cpus=cpus, numa_node=bound)


def apply_affinity(local_rank: int, local_world_size: int, threads: int | None = None) -> Affinity:
    """Bind this process to its NUMA node (when there are several) and set torch's thread count."""
    available = (
        frozenset(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else frozenset(range(os.cpu_count() or 1))
    )
    plan = plan_affinity(local_rank, local_world_size, numa_nodes(), available, threads)
    if plan.numa_node is not None and plan.cpus != available:
        os.sched_setaffinity(0, plan.cpus)
    torch.set_num_threads(plan.threads)
    return plan
