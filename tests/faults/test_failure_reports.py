"""Failures the launcher must report right and end fast: a SIGKILLed rank among SIGTERMed peers, restarts
that run out, a SIGSTOPped rank, and a node that died."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.faults.helpers import needs_proc, wait_for
from tests.helpers.cli import ROOT, kill_all, kill_tree, meshkit
from tests.helpers.distributed import free_port

KILLED_RANK = """
import os, signal, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)  # e.g. the kernel's out-of-memory killer
dist.barrier()  # rank 0 waits here until the agent stops it with SIGTERM
"""

STOPPED_RANK = """
import os, signal, time
import torch
from meshkit import Engine

engine = Engine()
model = torch.nn.Linear(4, 4)
model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(6):
    if step == 2 and engine.process_index == 1:
        print(f"STOPPED AT {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: it never reacts to SIGTERM
    engine.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()
engine.end()
"""


def test_the_killed_rank_is_blamed_not_the_one_the_launcher_stopped(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(KILLED_RANK)
    proc = meshkit("launch", "--nproc-per-node", "2", "--max-restarts", "1", str(script), timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("meshkit launch: rank 1 (local rank 1) was killed by signal SIGKILL"), last
    assert last.endswith("restarts used up (1 of 1)"), last


OWN_ERROR = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    raise ValueError("boom on rank 1")
dist.barrier()
"""


def test_peers_that_lost_the_killed_rank_say_so_in_one_line_each_and_log_their_tracebacks(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(KILLED_RANK)
    run = tmp_path / "run"
    proc = meshkit("launch", "--nproc-per-node", "4", "--set", f"logging.dir={run}", str(script), timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Connection closed by peer [" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "a peer is gone" in line]
    assert all(line.endswith(f"traceback in {run / 'launch-node0.log'}") for line in lines), lines
    if lines:  # (peers the agent stopped first print nothing at all)
        assert "Traceback" in (run / "launch-node0.log").read_text()
    assert proc.stderr.strip().splitlines()[-1].startswith("meshkit launch: rank 1 (local rank 1) was killed")


def test_a_ranks_own_error_keeps_its_traceback(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(OWN_ERROR)
    proc = meshkit("launch", "--nproc-per-node", "2", "--set", f"logging.dir={tmp_path / 'run'}", str(script))
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and 'raise ValueError("boom on rank 1")' in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("meshkit launch: rank 1 (local rank 1, exit code 1): ValueError: boom on rank 1"), last
    assert proc.stderr.count("Traceback") == 1  # rank 1's own; rank 0 only lost its peer


@needs_proc
def test_a_stopped_rank_is_killed_after_the_grace_and_the_job_ends(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(STOPPED_RANK)
    timeout_s = 3
    args = ["--set", f"collective_timeout_s={timeout_s}", "--set", "launch.stop_grace_s=2"]
    # a SIGSTOPped rank never resumes by itself: the job ends only if the launcher kills it (120 s: a hang guard)
    proc = meshkit("launch", "--nproc-per-node", "2", *args, str(script), timeout=120)
    assert "STOPPED AT" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "HangError" in last and "rank 1 (no heartbeat" in last, last


def _node(node_rank: int, port: int, script) -> subprocess.Popen:
    args = ["--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1", "--master-port", str(port)]
    return subprocess.Popen(
        [sys.executable, "-m", "meshkit.cli", "launch", *args, "--max-restarts", "1", "--rdzv-timeout", "8"]
        + [str(script)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@needs_proc
def test_a_dead_node_is_not_counted_as_present(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        f"open({str(tmp_path / 'started')!r} + str(dist.get_rank()), 'w').close()\n"
        "while True:\n    dist.barrier(); time.sleep(0.2)\n"
    )
    port = free_port()
    node0 = _node(0, port, script)
    time.sleep(0.5)  # node 0 hosts the rendezvous
    node1 = _node(1, port, script)
    try:
        wait_for(lambda: all((tmp_path / f"started{r}").exists() for r in (0, 1)), 90, "both nodes' workers")
        kill_tree(node1.pid)  # node 1 is lost: its launcher and worker die at once
        _, err = node0.communicate(timeout=90)
    finally:
        kill_all(node0, node1)
    assert node0.returncode != 0
    last = err.strip().splitlines()[-1]
    assert "expected 2 nodes, 1 alive (node 1 stopped responding" in last, err[-3000:]


class _Clock:
    """An exit clock that saw each pid's exit at a given time."""

    def __init__(self, seen: dict[int, float]) -> None:
        self.seen, self.killed = seen, set()

    def refresh(self) -> None:
        pass

    def exit_time(self, pid: int) -> float | None:
        return self.seen.get(pid)


def test_a_sigkilled_rank_seen_after_its_peers_error_is_still_the_root_cause(tmp_path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from meshkit.launching.failures import KILL_TEARDOWN_S, failure_report

    def failure(rank: int, exitcode: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(tmp_path / "none"))

    failures = {0: failure(0, 1), 3: failure(3, -9)}
    # the peer's error was seen one poll before the killed rank's exit became visible
    line, _ = failure_report(failures, 0, _Clock({100: 10.0, 103: 10.05}))
    assert line.startswith("rank 3 (local rank 3) was killed by signal SIGKILL"), line
    # an error well before a SIGKILL (the launcher did not send it) is still the first failure
    line, code = failure_report(failures, 0, _Clock({100: 10.0, 103: 10.0 + 2 * KILL_TEARDOWN_S}))
    assert line.startswith("rank 0 (local rank 0, exit code 1)") and code == 1, line


def test_the_out_of_memory_killer_is_named_when_the_cgroups_count_rose(tmp_path, monkeypatch) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from meshkit.launching import failures
    from meshkit.launching.memory_kills import oom_kill_count

    # cgroup v1 (the process's own memory cgroup) and v2 (the namespace's root) files, as the kernel writes them
    (tmp_path / "memory" / "job").mkdir(parents=True)
    (tmp_path / "memory" / "job" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (tmp_path / "v1").write_text("4:memory:/job\n1:cpu:/\n")
    assert oom_kill_count(tmp_path, tmp_path / "v1") == 3
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 2\noom_kill 1\noom_group_kill 0\n")
    (tmp_path / "v2").write_text("0::/elsewhere\n")
    assert oom_kill_count(tmp_path, tmp_path / "v2") == 1
    assert oom_kill_count(tmp_path / "none", tmp_path / "v2") is None

    killed = {2: ProcessFailure(local_rank=2, pid=102, exitcode=-9, error_file=str(tmp_path / "none"))}
    monkeypatch.setattr(failures, "oom_kill_count", lambda: 5)
    line, code = failures.failure_report(killed, 0, oom_kills_at_start=4)
    assert line.startswith("rank 2 (local rank 2) was killed by signal SIGKILL — most likely by the kernel's "
                           "out-of-memory killer (1 OOM kill in this job's memory cgroup"), line  # fmt: skip
    assert "lower micro_batch_size" in line and code == 1
    line, _ = failures.failure_report(killed, 0, oom_kills_at_start=5)  # no rise: the usual sender, not a verdict
    assert line.endswith("was killed by signal SIGKILL (nobody in the job sent it; the kernel's out-of-memory "
                         "killer is the usual sender: see `dmesg`)"), line  # fmt: skip
    clock = _Clock({102: 1.0})
    clock.killed = {102}  # the launcher's own kill after the grace: no hint
    line, _ = failures.failure_report(killed, 0, clock, oom_kills_at_start=4)
    assert line == "rank 2 (local rank 2) was killed by signal SIGKILL", line
