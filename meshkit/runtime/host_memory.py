"""Resident memory of CPU ranks held to what the first steps needed.

glibc's malloc keeps what a process frees. Past its dynamic mmap threshold (raised to the largest block freed
so far, up to 32 MB) large tensors — gradients, reduction buckets, gathered parameters — come from the heap,
where free blocks fragment and stay resident. Measured on 4 CPU ranks over 100 steps: resident memory settles
40–100 MB above its level after step 2 and swings by ±20 MB, on every ZeRO stage (torch's DDP and FSDP
included); no tensor is leaked. After each optimizer step the guard reads the resident size (/proc, a few
microseconds) and, when it exceeds the most the first three steps held by more than `host_memory_slack_mb`, hands
the free heap pages back to the system (glibc's `malloc_trim`). Elsewhere (another libc, macOS) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

from meshkit.runtime.memory import current_rss_bytes

WARMUP_STEPS = 3


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


class ResidentGuard:
    """Call `after_step()` after every optimizer step; `slack_mb` None turns it off."""

    def __init__(self, slack_mb: float | None) -> None:
        self._trim = _malloc_trim() if slack_mb is not None else None
        self.slack = int((slack_mb or 0) * 2**20)
        self.steps = 0
        self.baseline: int | None = None
        self.trims = 0

    def after_step(self) -> None:
        if self._trim is None:
            return
        self.steps += 1
        now = current_rss_bytes()
        if self.steps <= WARMUP_STEPS:  # the working set of a step: the most the first steps needed
            self.baseline = max(self.baseline or 0, now)
        elif self.baseline is not None and now > self.baseline + self.slack:
            self._trim(0)
            self.trims += 1
