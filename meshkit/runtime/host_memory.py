"""Resident memory of CPU ranks held to what the first step needed, without slowing the step.

glibc's malloc keeps what a process frees. Past its dynamic mmap threshold (raised to the largest block freed
so far, up to 32 MB) large tensors — gradients, reduction buckets, gathered parameters, activations — come from
the heap, where free blocks fragment: each step's peak lands a little higher than the last. Measured at world 4
on 24 × Linear(2048, 2048) with SGD momentum over 20 steps (`bench/peak_memory.py`): the peak rose by 50–100 MB
after step 1 on DDP and ZeRO-0/1, and by 1.1–1.2 GB on ZeRO-3, whose live tensors need 0.8 GB. No tensor leaked.

A step frees and takes back the same large blocks every time (gradients, gathered parameters, buckets). What
keeps the peak flat *and* the step fast is an allocator that caches those blocks by size, as torch's CUDA
allocator does on GPUs. Two measures, for CPU workers the launcher starts (`allocator_env`):
- `tcmalloc` (gperftools' `libtcmalloc_minimal`, where the system has it — `apt install libtcmalloc-minimal4`,
  `conda install gperftools`): preloaded into the workers. It keeps freed spans and hands them out again, so
  nothing is faulted in twice: on that bench every layout's peak stayed within about 2 % of step 1's (ZeRO-3:
  0.8 GB against glibc's 1.9 → 2.5 GB); ZeRO-1/2 stepped at 0.72–0.76× glibc's time, the rest as fast (torch's
  CPU tuning guide recommends the same allocator). It settles within a few steps, a block or two above step 1.
- Without it, glibc tunables: a fixed mmap threshold (which also turns the dynamic one off) maps every block of
  4 MB or more on its own and unmaps it when freed, so it never fragments the heap (growth within 25 MB on every
  layout), on transparent huge pages (`glibc.malloc.hugetlb`; 4 kB pages cost ZeRO-3 40–65 %). The price is the
  kernel zeroing every fresh block (~0.17 s per GB here): ZeRO-2 1.23×, ZeRO-3 1.38× glibc's step on that bench,
  as they free and take back every gradient or gathered parameter each step. Where the kernel has huge pages
  off, malloc is left alone.
Both are read once at process start, so they go in the workers' environment; `host_allocator` chooses
(`auto`: tcmalloc where found, else glibc's tunables) and `host_memory_slack_mb: null` turns both off.

`ResidentGuard`, after each optimizer step: it reads the resident size (/proc, a few microseconds) and, when it
exceeds the most the first three steps held by more than `host_memory_slack_mb`, hands the free pages back to
the system (tcmalloc's `MallocExtension_ReleaseFreeMemory`, else glibc's `malloc_trim`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from meshkit.core.errors import MeshkitError
from meshkit.runtime.memory import current_rss_bytes

WARMUP_STEPS = 3
MMAP_THRESHOLD_BYTES = 4 * 2**20  # blocks this large or larger: mapped on their own, returned when freed
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TCMALLOC_LIBRARIES = ("tcmalloc_minimal", "tcmalloc")  # gperftools' libraries, the smaller first
ALLOCATOR_CHOICES = ("auto", "tcmalloc", "glibc")
_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_CONF", "TCMALLOC_RELEASE_RATE")


class AllocatorError(MeshkitError):
    """`host_allocator: tcmalloc` on a system without gperftools' library."""


def _libc_function(name: str) -> Callable[..., int] | None:
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


def find_tcmalloc() -> str | None:
    """The file name of gperftools' tcmalloc as the dynamic loader finds it (e.g. `libtcmalloc_minimal.so.4`)."""
    for name in TCMALLOC_LIBRARIES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def allocator_env(
    environ: Mapping[str, str],
    choice: str = "auto",
    huge_pages: Path = THP_SETTING,
    tcmalloc: str | None | Callable[[], str | None] = find_tcmalloc,
    platform: str = sys.platform,
) -> dict[str, str]:
    """What the launcher adds to its workers' environment (see the module text). Nothing where the person chose
    malloc settings or preloaded an allocator already, or off Linux (both measures are Linux's: LD_PRELOAD and
    glibc)."""
    if choice not in ALLOCATOR_CHOICES:
        raise AllocatorError(f"host_allocator: {choice!r} is not one of {', '.join(ALLOCATOR_CHOICES)}")
    if not platform.startswith("linux"):
        if choice == "tcmalloc":
            raise AllocatorError(f"host_allocator: tcmalloc is preloaded on Linux only, not {platform}; set auto")
        return {}
    preloaded = environ.get("LD_PRELOAD", "")
    chosen = environ.get("GLIBC_TUNABLES", "")
    if any(name in environ for name in _MALLOC_SETTINGS) or "glibc.malloc." in chosen or "malloc" in preloaded:
        return {}
    if choice != "glibc":
        library = tcmalloc() if callable(tcmalloc) else tcmalloc
        if library:
            return {
                "LD_PRELOAD": f"{library}:{preloaded}" if preloaded else library,
                # tcmalloc reports every allocation of 1 GB or more on stderr; a model's buffers may well be
                "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**62),
            }
        if choice == "tcmalloc":
            raise AllocatorError(
                "host_allocator: tcmalloc, but gperftools' libtcmalloc is not installed: install it "
                "(apt install libtcmalloc-minimal4, or conda install gperftools) or set host_allocator: auto"
            )
    try:
        mode = huge_pages.read_text()
    except OSError:
        return {}  # not Linux, or no transparent huge pages: leave malloc as it is
    if "[never]" in mode:
        return {}
    tunables = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}:glibc.malloc.hugetlb=1"
    return {"GLIBC_TUNABLES": f"{chosen}:{tunables}" if chosen else tunables}


def _release_function() -> Callable[..., int] | None:
    """tcmalloc's `MallocExtension_ReleaseFreeMemory` where this process runs on it, else glibc's trim."""
    try:
        release = ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory
    except (OSError, AttributeError):
        trim = _libc_function("malloc_trim")
        return (lambda: trim(0)) if trim is not None else None
    return lambda: release()


class ResidentGuard:
    """Call `after_step()` after every optimizer step; `slack_mb` None turns it off."""

    def __init__(self, slack_mb: float | None) -> None:
        self._release = _release_function() if slack_mb is not None else None
        self.slack = int((slack_mb or 0) * 2**20)
        self.steps = 0
        self.baseline: int | None = None
        self.trims = 0

    def after_step(self) -> None:
        if self._release is None:
            return
        self.steps += 1
        now = current_rss_bytes()
        if self.steps <= WARMUP_STEPS:  # the working set of a step: the most the first steps needed
            self.baseline = max(self.baseline or 0, now)
        elif self.baseline is not None and now > self.baseline + self.slack:
            self._release()
            self.trims += 1
