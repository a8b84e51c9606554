"""Ranks leave the process group together, and a world that loses a rank names the cause, not the consequence."""

from __future__ import annotations

import os
import queue
import time

import pytest
import torch
import torch.distributed as dist

from meshkit.runtime.mesh import stop_process_group
from tests.helpers.distributed import _failure, run_world

LOST = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:15773"


def leave_after(rank: int, delay_s: float) -> tuple[float, float]:
    """When this rank began and ended `stop_process_group` (the last rank arrives `delay_s` late); one host's
    clock, so the ranks' times compare."""
    dist.init_process_group("gloo")
    if rank == dist.get_world_size() - 1:
        time.sleep(delay_s)
    arrived = time.time()
    stop_process_group(wait_for_peers=True)
    assert not dist.is_initialized()
    return arrived, time.time()


def test_a_rank_leaves_only_when_every_peer_is_done() -> None:
    times = run_world(leave_after, 3, 0.5, timeout=60)
    late_arrival = times[2][0]
    assert all(arrived < late_arrival for arrived, _ in times[:2]), times  # the early ranks came first
    assert all(left >= late_arrival for _, left in times), times  # and none left before the last one came


def exit_while_a_peer_waits(rank: int) -> None:
    dist.init_process_group("gloo")
    if rank == 0:
        os._exit(3)  # gone without a word, as a crash
    dist.recv(torch.zeros(1), src=0)


def test_a_rank_that_exits_is_named_by_the_peer_it_left_waiting() -> None:
    with pytest.raises(AssertionError) as failed:
        run_world(exit_while_a_peer_waits, 2, timeout=60)
    assert "rank 1 failed" in str(failed.value)
    assert "exited without a result (exit codes): {0: 3}" in str(failed.value)


class _Ended:
    exitcode = 0


class _Running:
    exitcode = None


def test_the_cause_is_reported_when_the_consequence_arrives_first() -> None:
    later: queue.Queue = queue.Queue()
    later.put((0, False, "ValueError: the real cause"))
    error = _failure(1, LOST, later, [_Ended(), _Ended()], {})
    assert str(error) == "rank 0 failed (ranks [1] failed too):\nValueError: the real cause"


class _Unread(queue.Queue):
    """Results that must not be waited for."""

    def get(self, *args, **kwargs):
        raise AssertionError("waited for the other ranks' reports")


def test_a_plain_failure_is_reported_at_once() -> None:
    # no grace wait for the other ranks when the failure is its own cause
    error = _failure(1, "ValueError: wrong shape", _Unread(), [_Running(), _Running()], {})
    assert str(error) == "rank 1 failed:\nValueError: wrong shape"
