"""What a device and its links can do, for the planner's step-time model: named presets from vendor data
sheets, flags, or a profile measured on the machine itself (`meshkit bench comm --profile`).

Bandwidths are GB/s (10^9 bytes) per device in one direction, as a ring collective sees them: NVLink's
"900 GB/s" (both directions) is 450 here, a 400 Gb/s InfiniBand NIC per GPU is 50.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from meshkit.core.errors import MeshkitError


class HardwareError(MeshkitError):
    """An unknown preset or an unreadable profile."""


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense tensor-core peak per device at the run's precision (bf16 for the presets)
    memory_gb: float  # device memory
    memory_tbps: float  # device memory bandwidth (the optimizer step is bound by it)
    intra_gbps: float  # per device, inside a node (NVLink / PCIe / shared memory)
    inter_gbps: float  # per device, between nodes (one NIC per device on the presets' systems)
    intra_latency_s: float = 10e-6  # per collective step
    inter_latency_s: float = 20e-6
    host_gbps: float = 25.0  # device <-> host (PCIe), for CPU offload
    matmul_efficiency: float = 0.6  # the fraction of peak large matmuls reach in training (kernels, not comms)
    ranks_per_device: float = 1.0  # > 1: ranks share compute (CPU ranks over fewer cores): an idle rank's share
    # goes to the busy ones, so a pipeline bubble costs less than on a device of one's own
    tp_overhead_s: dict[int, float] = field(default_factory=dict)  # measured (`layout: auto`): seconds per block
    # and micro-batch that splitting it over tp ranks adds beyond its 1/tp share and the modelled all-reduces
    # (host dispatch of the split tensors, waiting for peers); none for the data-sheet presets
    source: str = ""

    def with_links(self, intra: str | None = None, inter: str | None = None) -> Hardware:
        """The same device with the planner's named link classes (--intra-node, --inter-node) applied."""
        changes: dict[str, Any] = {}
        if intra is not None:
            changes["intra_gbps"], changes["intra_latency_s"] = LINKS[intra]
        if inter is not None:
            changes["inter_gbps"], changes["inter_latency_s"] = LINKS[inter]
        return replace(self, **changes)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# Link classes the planner's --intra-node / --inter-node name: (GB/s per device one way, latency per step)
LINKS: dict[str, tuple[float, float]] = {
    "nvlink": (300.0, 10e-6),  # NVLink 3 (A100): 600 GB/s both ways
    "nvlink4": (450.0, 10e-6),  # NVLink 4 (H100/H200): 900 GB/s both ways
    "pcie": (25.0, 20e-6),  # PCIe 4.0 x16, ~25 GB/s achieved
    "ib": (25.0, 20e-6),  # HDR InfiniBand, 200 Gb/s per GPU
    "ib-ndr": (50.0, 20e-6),  # NDR InfiniBand, 400 Gb/s per GPU
    "ethernet": (3.0, 50e-6),  # 25 GbE shared by the node
}

PRESETS: dict[str, Hardware] = {
    "a100": Hardware(
        "a100",
        312.0,
        80.0,
        2.0,
        300.0,
        25.0,
        host_gbps=25.0,
        source="NVIDIA A100 data sheet (SXM4 80GB): 312 TFLOP/s BF16 dense, 2.0 TB/s HBM2e, NVLink 600 GB/s; "
        "DGX A100: 8x HDR 200 Gb/s InfiniBand",
    ),
    "a100-40gb": Hardware(
        "a100-40gb",
        312.0,
        40.0,
        1.555,
        300.0,
        25.0,
        host_gbps=25.0,
        source="NVIDIA A100 data sheet (SXM4 40GB): 312 TFLOP/s BF16 dense, 1.555 TB/s HBM2",
    ),
    "h100": Hardware(
        "h100",
        989.0,
        80.0,
        3.35,
        450.0,
        50.0,
        host_gbps=50.0,
        source="NVIDIA H100 data sheet (SXM5): 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s; "
        "DGX H100: 8x NDR 400 Gb/s InfiniBand",
    ),
    "h200": Hardware(
        "h200",
        989.0,
        141.0,
        4.8,
        450.0,
        50.0,
        host_gbps=50.0,
        source="NVIDIA H200 data sheet (SXM): 989 TFLOP/s BF16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s",
    ),
    "l40s": Hardware(
        "l40s",
        362.0,
        48.0,
        0.864,
        25.0,
        12.5,
        intra_latency_s=20e-6,
        inter_latency_s=50e-6,
        host_gbps=25.0,
        source="NVIDIA L40S data sheet: 362 TFLOP/s BF16 dense, 48 GB GDDR6 at 864 GB/s, PCIe 4.0 x16; "
        "100 GbE between nodes",
    ),
}


def preset(name: str) -> Hardware:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise HardwareError(f"--gpu {name}: unknown device; choose one of {', '.join(PRESETS)}") from None


def save_profile(hardware: Hardware, path: Path) -> None:
    """Write a measured profile (JSON) that `meshkit plan --profile` reads; atomic."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(hardware.as_json(), indent=2) + "\n")
    partial.replace(path)


def load_profile(path: Path) -> Hardware:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HardwareError(
            f"--profile {path}: cannot read it ({err}); write one with meshkit bench comm --profile"
        ) from None
    known = {f.name for f in fields(Hardware)}
    missing = [f.name for f in fields(Hardware) if f.default is MISSING and f.name not in data]
    unknown = sorted(set(data) - known)
    if missing or unknown:
        raise HardwareError(
            f"--profile {path}: "
            + (f"missing {', '.join(missing)}" if missing else f"unknown keys {', '.join(unknown)}")
        )
    data["tp_overhead_s"] = {int(tp): float(s) for tp, s in data.get("tp_overhead_s", {}).items()}
    return Hardware(**data)
