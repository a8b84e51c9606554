"""`meshkit env`: versions, devices and backends, for bug reports."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys

import torch
import torch.distributed as dist

from meshkit.launching.affinity import numa_nodes
from meshkit.runtime.devices import cuda_versions, gpus


def environment_rows() -> list[tuple[str, str]]:
    cuda = torch.cuda.is_available()
    cuda_build, nccl = cuda_versions()
    backends = [
        name for name in ("gloo", "nccl", "mpi", "ucc") if getattr(dist, f"is_{name}_available", lambda: False)()
    ]
    rows = [
        ("meshkit", importlib.metadata.version("meshkit")),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("cuda available", str(cuda)),
        ("cuda (torch build)", cuda_build),
        ("nccl", nccl),
        ("gpus", str(len(gpus()))),
        *((f"gpu {gpu.index}", gpu.describe()) for gpu in gpus()),
        ("distributed backends", ", ".join(backends) or "none"),
        ("default device / backend", "cuda / nccl" if cuda else "cpu / gloo"),
        (
            "cpu cores (usable)",
            str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
        ),
        ("numa nodes", str(len(numa_nodes()) or 1)),
        ("torch threads", str(torch.get_num_threads())),
    ]
    for package in ("safetensors", "pydantic", "yaml", "typer", "rich", "tensorboard", "matplotlib"):
        try:
            module = importlib.import_module(package)
            rows.append((package, getattr(module, "__version__", "installed")))
        except ImportError:
            rows.append((package, "not installed"))
    return rows
