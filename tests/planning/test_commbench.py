"""`meshkit bench comm`: bus bandwidth factors as nccl-tests defines them, and a run at world 2."""

from __future__ import annotations

import json

import pytest

from meshkit.planning.commbench import CommBenchError, bus_factor, parse_sizes
from tests.helpers.cli import meshkit


def test_bus_factors() -> None:
    assert bus_factor("all_reduce", 4) == 1.5  # 2(n-1)/n
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 0.75  # (n-1)/n
    assert bus_factor("broadcast", 4) == 1.0
    with pytest.raises(CommBenchError, match="unknown op 'alltoall'"):
        bus_factor("alltoall", 4)


def test_sizes_are_binary_like_nccl_tests() -> None:
    assert parse_sizes("1M,16M,512K") == [2**20, 16 * 2**20, 512 * 2**10]
    with pytest.raises(CommBenchError, match="'lots' is not a size"):
        parse_sizes("1M,lots")


@pytest.mark.slow
def test_bench_comm_at_world_2_reports_busbw_with_the_right_factor(tmp_path) -> None:
    out = tmp_path / "comm.json"
    args = ("--nproc-per-node", "2", "--sizes", "64K,256K", "--iters", "5", "--out", str(out))
    proc = meshkit("bench", "comm", *args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ranks"] == 2 and {row["op"] for row in report["rows"]} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
    }
    expected = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}  # n = 2
    for row in report["rows"]:
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * expected[row["op"]])
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["time_us"] / 1e6) / 1e9)
    assert all(row["vs_bare"] > 0 for row in report["rows"] if row["op"] == "all_reduce")
    assert "busbw GB/s" in proc.stdout
    bad = meshkit("bench", "comm", "--ops", "alltoall")
    assert bad.returncode == 2 and "unknown op 'alltoall'" in bad.stderr
