"""The allocator the launcher gives CPU workers (tcmalloc where installed, else glibc tunables), and who decides."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshkit.config import LaunchSettings, RunConfig
from meshkit.launching.launch import LaunchPlan
from meshkit.launching.stores import node_addresses
from meshkit.runtime.host_memory import (
    MMAP_THRESHOLD_BYTES,
    AllocatorError,
    ResidentGuard,
    allocator_env,
)


@pytest.fixture
def huge_pages(tmp_path: Path) -> Path:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    return setting


def test_workers_map_large_blocks_on_their_own_on_huge_pages(huge_pages: Path) -> None:
    tunables = allocator_env({}, "auto", huge_pages, tcmalloc=None)["GLIBC_TUNABLES"]
    assert f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}" in tunables
    assert "glibc.malloc.hugetlb=1" in tunables


def test_tunables_a_person_set_are_kept_and_added_to(huge_pages: Path) -> None:
    joined = allocator_env({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, "glibc", huge_pages)["GLIBC_TUNABLES"]
    assert joined.startswith("glibc.pthread.rseq=0:") and "mmap_threshold" in joined


@pytest.mark.parametrize(
    "environ",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"MALLOC_TOP_PAD_": "0"},
        {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
        {"MALLOC_CONF": "background_thread:true"},
    ],
)
def test_malloc_settings_a_person_chose_win(environ: dict[str, str], huge_pages: Path) -> None:
    assert allocator_env(environ, "auto", huge_pages, tcmalloc="libtcmalloc_minimal.so.4") == {}


def test_without_huge_pages_malloc_is_left_alone(tmp_path: Path) -> None:
    """On 4 kB pages, faulting each step's fresh blocks in costs more than the fragmentation it saves."""
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    assert allocator_env({}, "auto", never, tcmalloc=None) == {}
    assert allocator_env({}, "glibc", tmp_path / "absent") == {}  # not Linux, or no transparent huge pages


def test_tcmalloc_is_preloaded_where_installed(huge_pages: Path) -> None:
    """It caches freed blocks: flat and fast, where glibc's fixed threshold is flat but faults blocks in."""
    env = allocator_env({"LD_PRELOAD": "libfoo.so"}, "auto", huge_pages, tcmalloc="libtcmalloc_minimal.so.4")
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libfoo.so" and "GLIBC_TUNABLES" not in env
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) > 2**40  # no stderr line per large tensor
    assert "LD_PRELOAD" not in allocator_env({}, "glibc", huge_pages, tcmalloc="libtcmalloc_minimal.so.4")


def test_tcmalloc_asked_for_but_missing_says_what_to_install(huge_pages: Path) -> None:
    with pytest.raises(AllocatorError, match="apt install libtcmalloc-minimal4.*host_allocator: auto"):
        allocator_env({}, "tcmalloc", huge_pages, tcmalloc=None)
    with pytest.raises(AllocatorError, match="'jemalloc' is not one of auto, tcmalloc, glibc"):
        allocator_env({}, "jemalloc", huge_pages)


def test_off_linux_nothing_is_set_and_tcmalloc_asked_for_says_why(huge_pages: Path) -> None:
    assert allocator_env({}, "auto", huge_pages, tcmalloc="libtcmalloc_minimal.4.dylib", platform="darwin") == {}
    with pytest.raises(AllocatorError, match="Linux only, not darwin; set auto"):
        allocator_env({}, "tcmalloc", huge_pages, tcmalloc="libtcmalloc_minimal.4.dylib", platform="darwin")


def test_the_guard_hands_pages_back_only_past_the_slack(monkeypatch) -> None:
    released: list[bool] = []
    sizes = iter([100, 120, 110, 125, 140, 150])  # MB: the first 3 steps set the baseline (120)
    monkeypatch.setattr("meshkit.runtime.host_memory._release_function", lambda: lambda: released.append(True))
    monkeypatch.setattr("meshkit.runtime.host_memory.current_rss_bytes", lambda: next(sizes) * 2**20)
    guard = ResidentGuard(slack_mb=16)
    for _ in range(6):
        guard.after_step()
    assert guard.baseline == 120 * 2**20 and guard.trims == 2  # 140 and 150 exceed 120 + 16; 125 does not
    assert ResidentGuard(slack_mb=None)._release is None


def test_the_launcher_passes_them_on_unless_host_memory_handling_is_off(monkeypatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    settings = LaunchSettings(nproc_per_node=2)
    on_cpu = LaunchPlan.from_config(RunConfig(device="cpu"))
    off = LaunchPlan.from_config(RunConfig(device="cpu", host_memory_slack_mb=None))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    expected = allocator_env({})
    assert on_cpu.allocator == "auto" and off.allocator is None
    assert LaunchPlan.from_config(RunConfig(device="cpu", host_allocator="glibc")).allocator == "glibc"
    given = on_cpu.worker_env(node_addresses(settings))
    for name in ("GLIBC_TUNABLES", "LD_PRELOAD"):
        assert given.get(name) == expected.get(name)
    assert "GLIBC_TUNABLES" not in off.worker_env(node_addresses(settings))
    assert "LD_PRELOAD" not in off.worker_env(node_addresses(settings))
    on_gpu = LaunchPlan.from_config(RunConfig(device="cuda"))
    assert "GLIBC_TUNABLES" not in on_gpu.worker_env(node_addresses(settings))
    assert "LD_PRELOAD" not in on_gpu.worker_env(node_addresses(settings))
