"""Resident memory of CPU ranks held to what the first step needed.

glibc's malloc keeps what a process frees. Past its dynamic mmap threshold (raised to the largest block freed
so far, up to 32 MB) large tensors — gradients, reduction buckets, gathered parameters, activations — come from
the heap, where free blocks fragment: each step's peak lands a little higher than the last. Measured at world 4
on 24 × Linear(2048, 2048) with SGD momentum over 20 steps (`bench/peak_memory.py`): the peak rose by 50–100 MB
after step 1 on DDP and ZeRO-0/1, and by 1.2 GB on ZeRO-3, whose live tensors need 0.8 GB. No tensor was leaked.

Two measures, both glibc-only (elsewhere they do nothing):
- `allocator_env`: the launcher starts its workers with a fixed mmap threshold (which also turns the dynamic one
  off): every block of 4 MB or more is mapped on its own and unmapped when freed, so it never fragments the
  heap and the peak of step 1 is the peak of the run (the same bench: growth within 20 MB, 1.3 %, on every
  layout; ZeRO-3's peak 0.8 GB instead of 2.7 GB). Those mappings are backed by transparent huge pages
  (`glibc.malloc.hugetlb`): with 4 kB pages, faulting each step's fresh blocks in cost ZeRO-3 40–65 % step time;
  with huge pages DDP and ZeRO-0/1 step as fast as before and ZeRO-2/3, which free and take back every gradient
  or gathered parameter each step, 10–19 % slower on that 2-core host. Both are glibc tunables, read once at
  process start, so they go in the workers' environment; where the kernel has huge pages off, the threshold is
  left alone. `host_memory_slack_mb: null` keeps glibc's own settings.
- `ResidentGuard`, after each optimizer step: it reads the resident size (/proc, a few microseconds) and, when
  it exceeds the most the first three steps held by more than `host_memory_slack_mb`, hands the free heap
  pages back to the system (`malloc_trim`) — the smaller blocks still come from the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Mapping
from pathlib import Path

from meshkit.runtime.memory import current_rss_bytes

WARMUP_STEPS = 3
MMAP_THRESHOLD_BYTES = 4 * 2**20  # blocks this large or larger: mapped on their own, returned when freed
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _libc_function(name: str) -> Callable[..., int] | None:
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


def allocator_env(environ: Mapping[str, str], huge_pages: Path = THP_SETTING) -> dict[str, str]:
    """What the launcher adds to its workers' environment: glibc tunables for a fixed mmap threshold on huge
    pages. Nothing where the person chose malloc settings already, or huge pages are off (`never`)."""
    if any(name in environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")):
        return {}
    chosen = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in chosen:
        return {}
    try:
        mode = huge_pages.read_text()
    except OSError:
        return {}  # not Linux, or no transparent huge pages: leave malloc as it is
    if "[never]" in mode:
        return {}
    tunables = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}:glibc.malloc.hugetlb=1"
    return {"GLIBC_TUNABLES": f"{chosen}:{tunables}" if chosen else tunables}


class ResidentGuard:
    """Call `after_step()` after every optimizer step; `slack_mb` None turns it off."""

    def __init__(self, slack_mb: float | None) -> None:
        self._trim = _libc_function("malloc_trim") if slack_mb is not None else None
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
