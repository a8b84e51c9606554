"""Threads per rank and NUMA binding plans (fake topologies; the real host may have one node)."""

from __future__ import annotations

from meshkit.launching.affinity import node_for_local_rank, numa_nodes, parse_cpulist, plan_affinity


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == frozenset()


def test_numa_nodes_from_sysfs(tmp_path) -> None:
    for node, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node2", "")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    assert numa_nodes(tmp_path) == [frozenset(range(4)), frozenset(range(4, 8))]
    assert numa_nodes(tmp_path / "missing") == []


def test_two_nodes_bind_contiguous_rank_groups() -> None:
    nodes = [frozenset(range(8)), frozenset(range(8, 16))]
    assert [node_for_local_rank(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    plan = plan_affinity(3, 4, nodes, frozenset(range(16)))
    assert plan.numa_node == 1 and plan.cpus == nodes[1] and plan.threads == 4  # 8 cores shared by 2 ranks


def test_one_node_is_a_no_op_with_a_fair_thread_share() -> None:
    available = frozenset(range(2))
    plan = plan_affinity(0, 4, [available], available)
    assert plan.numa_node is None and plan.cpus == available and plan.threads == 1
    assert plan_affinity(0, 1, [], available, threads=3).threads == 3
