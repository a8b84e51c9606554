"""Measure this machine for the planner: matmul rate and memory bandwidth on every rank at once (ranks share
what they share in training), and the link's all-reduce bandwidth and per-step latency. The result is a
`Hardware` profile (`meshkit bench comm --profile FILE`, read by `meshkit plan --profile FILE`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from meshkit.planning.hardware import Hardware

LATENCY_BYTES = 4096


def _slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def timed(call: Any, device: torch.device, min_seconds: float = 0.0, calls: int | None = None) -> float:
    """Seconds per call on the slowest rank, every rank calling at the same time: for `min_seconds` (a call
    without collectives: each rank may make a different number of calls), or exactly `calls` times (a call
    with a collective inside must be made as often on every rank, or the collectives pair up wrongly)."""
    call()
    dist.barrier()
    made, start = 0, time.perf_counter()
    while True:
        call()
        made += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if made == calls if calls is not None else time.perf_counter() - start >= min_seconds:
            break
    return _slowest((time.perf_counter() - start) / made, device)


def matmul_tflops(
    device: torch.device,
    dtype: torch.dtype,
    size: int,
    min_seconds: float = 1.0,
    shape: tuple[int, int, int] | None = None,
) -> float:
    """TFLOP/s of (m×k)·(k×n) matmuls, square `size` unless `shape` gives (m, k, n) — a model's own GEMMs."""
    m, k, n = shape or (size, size, size)
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    seconds = timed(lambda: torch.mm(a, b), device, min_seconds)
    return 2 * m * k * n / seconds / 1e12


def memory_tbps(device: torch.device, megabytes: int, min_seconds: float = 0.5) -> float:
    source = torch.ones(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), device, min_seconds)
    return 2 * source.numel() * 4 / seconds / 1e12  # read and write


def all_reduce_latency(device: torch.device, min_seconds: float = 0.3) -> float:
    """Seconds per ring step (2(n−1) per all-reduce) of a tiny all-reduce issued between compute, as tensor
    parallel issues them: the time it adds to a loop of small matmuls. Where ranks share cores this includes
    waiting for the peers to be scheduled, which an idle ping-pong would not show."""
    ranks = dist.get_world_size()
    tensor = torch.ones(LATENCY_BYTES // 4, device=device)
    a = torch.randn(128, 128, device=device)

    def compute() -> None:
        torch.mm(a, a)

    def compute_then_reduce() -> None:
        torch.mm(a, a)
        dist.all_reduce(tensor)

    calls = max(10, int(min_seconds / 3e-3))  # fixed: every rank makes the same all-reduces
    extra = timed(compute_then_reduce, device, calls=calls) - timed(compute, device, calls=calls)
    return max(extra, 1e-6) / max(1, 2 * (ranks - 1))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _local_ranks() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def device_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    return pages / 1e9 / max(1, _local_ranks())  # host memory, shared by this node's ranks


def link_gbps(device: torch.device, megabytes: int = 8) -> float:
    """All-reduce bus bandwidth (GB/s) at one size, as `meshkit bench comm` reports it."""
    ranks = dist.get_world_size()
    tensor = torch.ones(megabytes * 2**20 // 4, device=device)
    seconds = timed(lambda: dist.all_reduce(tensor), device, calls=10)
    return tensor.numel() * 4 / seconds / 1e9 * 2 * (ranks - 1) / max(1, ranks)


def measure_profile(
    rows: list[dict[str, Any]] | None,
    device: torch.device,
    quick: bool = False,
    matmul_shape: tuple[int, int, int] | None = None,
) -> Hardware:
    """A profile from the comm benchmark's rows (None: one all-reduce size measured here) and this world's own
    probes (collective: every rank calls it). `quick`: shorter probes (for `layout: auto`); `matmul_shape`:
    time the matmul rate at a model's own GEMM (tokens × hidden × hidden), not at a large square one."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    size = (8192 if cuda else 1024) // (2 if quick else 1)
    rate = matmul_tflops(device, dtype, size, 0.3 if quick else 1.0, shape=matmul_shape)
    memory = memory_tbps(device, 512 if cuda else 64, 0.2 if quick else 0.5)
    latency = all_reduce_latency(device)
    all_reduce = [row for row in rows or [] if row["op"] == "all_reduce"]
    link = max(all_reduce, key=lambda row: row["bytes"])["busbw_gbps"] if all_reduce else link_gbps(device)
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({dist.get_world_size()} ranks)"
    return Hardware(
        name=f"measured: {name}",
        peak_tflops=rate,
        memory_gb=device_memory_gb(device),
        memory_tbps=memory,
        intra_gbps=link,
        inter_gbps=link,
        intra_latency_s=latency,
        inter_latency_s=latency,
        host_gbps=memory * 1000 if not cuda else link,
        matmul_efficiency=1.0,  # the measured rate is what matmuls reach here
        ranks_per_device=1.0 if cuda else max(1.0, _local_ranks() / _cores()),
        source=f"meshkit bench comm --profile on {dist.get_world_size()} ranks ({dtype}); inter-node = "
        "intra-node (one node measured): edit inter_gbps / inter_latency_s for a multi-node plan",
    )
