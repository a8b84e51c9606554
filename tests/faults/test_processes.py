"""Faults of the process tree: the launcher killed (no orphans); and what a job listens on (loopback only)."""

from __future__ import annotations

import signal

import pytest

from tests.faults.helpers import background_meshkit, is_loopback, listening_addresses, needs_proc, running, wait_for

WORKER = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
out = sys.argv[1]
open(f"{out}/pid-{dist.get_rank()}.tmp", "w").write(f"{os.getpid()} {os.environ['MESHKIT_LAUNCHER_PID']}")
os.replace(f"{out}/pid-{dist.get_rank()}.tmp", f"{out}/pid-{dist.get_rank()}")
while True:  # trains forever, as an orphan would
    time.sleep(0.2)
"""


def _start(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(WORKER)
    return background_meshkit("launch", "--nproc-per-node", "2", str(script), str(tmp_path))


def _workers(tmp_path) -> tuple[list[int], int]:
    wait_for(lambda: all((tmp_path / f"pid-{r}").exists() for r in (0, 1)), 60, "both workers to start")
    pairs = [(tmp_path / f"pid-{r}").read_text().split() for r in (0, 1)]
    return [int(worker) for worker, _ in pairs], int(pairs[0][1])


@needs_proc
@pytest.mark.parametrize("kill", ["launcher", "process group"])
def test_workers_die_with_their_launcher(tmp_path, kill) -> None:
    with _start(tmp_path) as launcher:
        workers, launcher_pid = _workers(tmp_path)
        assert launcher_pid == launcher.pid and all(running(pid) for pid in workers)
        if kill == "launcher":  # first: every socket the job listens on is on loopback
            addresses = listening_addresses([launcher.pid, *workers])
            # The rendezvous store (launcher), the workers' store (rank 0) and gloo's own connections.
            assert len(addresses) >= 3, addresses
            assert all(is_loopback(address) for address in addresses), addresses
            launcher.send_signal(signal.SIGKILL)
        else:
            import os

            os.killpg(launcher.pid, signal.SIGKILL)  # the workers are in sessions of their own
        # the workers' script never ends by itself: only the launcher's death can stop them (60 s: a hang guard)
        wait_for(lambda: not any(running(pid) for pid in workers), 60, "the workers to die with the launcher")
