"""`meshkit launch`: start the workers of one node with torch's elastic agent, used as a library.

Node 0 hosts the rendezvous store on `master_addr:master_port` (loopback on one node), bound to that one
address; every node dials it first, quietly, so a node 0 that never comes is one line, not a C++ trace per
retry. While the agent runs, the launcher watches its workers (`supervisor`: who exited first, stalled
ranks killed after a grace, workers that die with the launcher), beats the node roster (a node that died is
not counted as present), turns the preemption signal into a checkpoint-and-stop, and keeps torch's C++
retry traces off the terminal (they go to `<logging.dir>/launch-node<N>.log`). Workers run through
`meshkit.launching.worker`, which records each rank's exception for the agent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from meshkit.config.schema import LaunchSettings
from meshkit.launching.failures import failure_report
from meshkit.launching.interfaces import quiet_port
from meshkit.launching.job import LaunchError, LaunchPlan, LaunchTarget  # noqa: F401 - LaunchError: importable here
from meshkit.launching.memory_kills import oom_kill_count
from meshkit.launching.roster import NodeRoster
from meshkit.launching.stderr_filter import filtered_stderr
from meshkit.launching.stores import LOOPBACK, WILDCARD, listen, node_addresses, serve, wait_reachable
from meshkit.launching.supervisor import WorkerSupervisor
from meshkit.launching.tolerant_agent import LostWorker, TolerantAgent, agent_class
from meshkit.runtime.preemption import PREEMPTED_EXIT_CODE, signal_number

RUN_ID_ENV = "MESHKIT_RUN_ID"


@contextlib.contextmanager
def _environment(updates: Mapping[str, str]) -> Iterator[None]:
    """Set variables for the workers (they inherit this process's environment), then restore."""
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def open_rendezvous_store(settings: LaunchSettings, port: int) -> tuple[TCPStore | None, str, int]:
    """Node 0 binds the store to its one address (loopback on one node); the others wait until it answers.

    The store is multi-tenant: the agent's own c10d rendezvous reuses this server in the same process.
    Returns (the server, or None on other nodes; the host the rendezvous dials; its port).
    """
    single = settings.nnodes == 1
    dial = LOOPBACK if single else settings.master_addr
    if settings.node_rank != 0:
        wait_reachable(dial, port, settings.rdzv_timeout_s, "--master-addr")
        return None, dial, port
    bind = WILDCARD if settings.bind_all_interfaces else dial
    store = serve(listen(bind, port, "--master-addr"), settings.rdzv_timeout_s)
    return store, dial, store.port


class _PreemptionHandler:
    """The launcher's handler of the preemption signal: the first one is passed on to the workers (their own
    process only: their data-loader children keep running) and starts the grace; the next one — sent by the
    supervisor once the checkpoint is announced, a worker exits or the grace is over — stops the agent."""

    def __init__(self, supervisor: WorkerSupervisor, grace_s: float) -> None:
        self.supervisor, self.grace_s = supervisor, grace_s

    def __call__(self, signum: int, frame: object) -> None:
        if self.supervisor.begin_shutdown(signum, self.grace_s):
            return
        raise SignalException(f"meshkit launch got {signal.Signals(signum).name}", sigval=signal.Signals(signum))


@contextlib.contextmanager
def _signal_handler(signum: int | None, handler: Any) -> Iterator[None]:
    if signum is None or threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: launched from another thread, torch's handling applies
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _agent_config(settings: LaunchSettings, run_id: str, endpoint: str, local_addr: str, signals: str) -> LaunchConfig:
    numa = None
    if torch.cuda.is_available():
        from torch.numa.binding import AffinityMode, NumaOptions

        numa = NumaOptions(affinity_mode=AffinityMode.NODE, should_fall_back_if_binding_fails=True)
    options: dict[str, Any] = {
        "min_nodes": settings.min_nnodes or settings.nnodes,
        "max_nodes": settings.nnodes,
        "nproc_per_node": settings.nproc_per_node,
        "run_id": run_id,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": endpoint,
        "rdzv_configs": {
            "is_host": settings.node_rank == 0,
            "join_timeout": max(1, int(settings.rdzv_timeout_s)),
            "last_call_timeout": max(1, int(settings.rdzv_last_call_s)),
        },
        "max_restarts": settings.max_restarts,
        "logs_specs": DefaultLogsSpecs(),
        "numa_options": numa,
        "local_addr": local_addr,
        "signals_to_handle": signals,  # (launch_agent puts it in TORCHELASTIC_SIGNALS_TO_HANDLE for the agent)
    }
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    if "shutdown_timeout" in names:  # after the preemption checkpoint the workers only have to exit
        options["shutdown_timeout"] = max(1, int(settings.stop_grace_s))
    return LaunchConfig(**{key: value for key, value in options.items() if key in names})


def launch(target: LaunchTarget, plan: LaunchPlan) -> int:
    """Run `target` on this node's workers; returns the job's exit code (0 when every rank succeeded).
    With `launch.backend: ray` the whole job runs on a Ray cluster instead (`ray_backend.py`)."""
    if plan.settings.backend == "ray":
        from meshkit.launching.ray_backend import launch_on_ray

        return launch_on_ray(target, plan)
    target.check()
    settings = plan.settings
    run_id = os.environ.get(RUN_ID_ENV, "meshkit")
    addresses = node_addresses(settings)
    store, host, port = open_rendezvous_store(settings, plan.port)
    config = _agent_config(settings, run_id, f"{host}:{port}", addresses.advertise, plan.agent_signals)
    preempt = signal_number(plan.preempt_signal)
    log = plan.log_dir / f"launch-node{settings.node_rank}.log" if plan.log_dir is not None else None
    with contextlib.ExitStack() as stack:  # unwound in reverse: the stderr filter goes last, the store after it
        stack.enter_context(filtered_stderr(log))
        supervisor = stack.enter_context(WorkerSupervisor(settings.stop_grace_s, preempt))
        roster = stack.enter_context(NodeRoster(host, port, run_id, settings.node_rank, settings.nnodes))
        stack.enter_context(_environment({**plan.worker_env(addresses), **supervisor.worker_env()}))
        handler = _PreemptionHandler(supervisor, settings.shutdown_grace_s)
        for name in plan.launcher_signals:
            stack.enter_context(_signal_handler(signal_number(name), handler))
        lost: list[LostWorker] = []
        one_node = settings.nnodes == 1
        worker_port = functools.partial(quiet_port, addresses.bind) if one_node else None
        agent = functools.partial(TolerantAgent, tolerated=supervisor.tolerated, lost=lost, worker_port=worker_port)
        stack.enter_context(agent_class(agent))
        oom_kills = oom_kill_count()
        try:
            launch_agent(config, sys.executable, target.worker_args())
        except ChildFailedError as err:
            if supervisor.preemption_announced() is not None:
                return _report_preemption(supervisor, _stopped_by(supervisor, plan.preempt_signal))
            line, code = failure_report(err.failures, settings.max_restarts, supervisor, oom_kills_at_start=oom_kills)
            print(f"meshkit launch: {line}", file=sys.stderr, flush=True)
            return code
        except SignalException as err:
            if preempt is not None and err.sigval == preempt or err.sigval == supervisor.stopped_by:
                return _report_preemption(supervisor, _stopped_by(supervisor, plan.preempt_signal))
            print(f"meshkit launch: stopped by {err.sigval.name}", file=sys.stderr, flush=True)
            return 128 + int(err.sigval)
        except RendezvousTimeoutError:
            low = settings.min_nnodes or settings.nnodes
            expected = str(settings.nnodes) if low == settings.nnodes else f"at least {low}"
            print(
                f"meshkit launch: rendezvous at {host}:{port} timed out after {settings.rdzv_timeout_s:g}s: "
                f"{roster.describe(expected)}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    for worker in lost:
        how = (
            f"killed by {signal.Signals(-worker.exitcode).name}"
            if worker.exitcode < 0
            else f"exit code {worker.exitcode}"
        )
        print(
            f"meshkit launch: rank {worker.rank} (local rank {worker.local_rank}) was lost ({how}); an asynchronous "
            "parameter-server worker, so the others finished without it",
            file=sys.stderr,
            flush=True,
        )
    del store  # after the roster's last beat: the server goes with the job
    return 0


def _stopped_by(supervisor: WorkerSupervisor, preempt_signal: str) -> str:
    """The name of the signal that began the shutdown: Ctrl-C's SIGINT, or the preemption signal."""
    return signal.Signals(supervisor.stopped_by).name if supervisor.stopped_by is not None else preempt_signal


def _report_preemption(supervisor: WorkerSupervisor, signal_name: str) -> int:
    announced = supervisor.preemption_announced()
    interrupted = signal_name == "SIGINT"  # Ctrl-C: the shell's code for it, 130, not "try again later"
    if announced is not None:
        how = "interrupted (SIGINT)" if interrupted else f"preempted by {signal_name}"
        print(
            f"meshkit launch: {how}: checkpoint {announced.get('checkpoint')} committed at step "
            f"{announced.get('step')}; run the same command again to resume from it (checkpoint.resume=auto)",
            file=sys.stderr,
            flush=True,
        )
        return 128 + signal.SIGINT if interrupted else PREEMPTED_EXIT_CODE
    print(
        f"meshkit launch: stopped by {signal_name} before a checkpoint was written (the script never reached "
        "engine.save_checkpoint() within launch.shutdown_grace_s, or does not call it)",
        file=sys.stderr,
        flush=True,
    )
    return 128 + int(signal_number(signal_name) or 15)
