"""The allocator settings the launcher gives CPU workers, and who decides them."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshkit.config import LaunchSettings, RunConfig
from meshkit.launching.launch import LaunchPlan
from meshkit.launching.stores import node_addresses
from meshkit.runtime.host_memory import MMAP_THRESHOLD_BYTES, allocator_env


@pytest.fixture
def huge_pages(tmp_path: Path) -> Path:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    return setting


def test_workers_map_large_blocks_on_their_own_on_huge_pages(huge_pages: Path) -> None:
    tunables = allocator_env({}, huge_pages)["GLIBC_TUNABLES"]
    assert f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}" in tunables
    assert "glibc.malloc.hugetlb=1" in tunables


def test_tunables_a_person_set_are_kept_and_added_to(huge_pages: Path) -> None:
    joined = allocator_env({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, huge_pages)["GLIBC_TUNABLES"]
    assert joined.startswith("glibc.pthread.rseq=0:") and "mmap_threshold" in joined


@pytest.mark.parametrize(
    "environ",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"MALLOC_TOP_PAD_": "0"},
    ],
)
def test_malloc_settings_a_person_chose_win(environ: dict[str, str], huge_pages: Path) -> None:
    assert allocator_env(environ, huge_pages) == {}


def test_without_huge_pages_malloc_is_left_alone(tmp_path: Path) -> None:
    """On 4 kB pages, faulting each step's fresh blocks in costs more than the fragmentation it saves."""
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    assert allocator_env({}, never) == {}
    assert allocator_env({}, tmp_path / "absent") == {}  # not Linux, or no transparent huge pages


def test_the_launcher_passes_them_on_unless_host_memory_handling_is_off(monkeypatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    settings = LaunchSettings(nproc_per_node=2)
    on_cpu = LaunchPlan.from_config(RunConfig(device="cpu"))
    off = LaunchPlan.from_config(RunConfig(device="cpu", host_memory_slack_mb=None))
    expected = allocator_env({})
    assert on_cpu.tune_allocator and not off.tune_allocator
    assert on_cpu.worker_env(node_addresses(settings)).get("GLIBC_TUNABLES") == expected.get("GLIBC_TUNABLES")
    assert "GLIBC_TUNABLES" not in off.worker_env(node_addresses(settings))
    on_gpu = LaunchPlan.from_config(RunConfig(device="cuda"))
    assert "GLIBC_TUNABLES" not in on_gpu.worker_env(node_addresses(settings))
