"""`meshkit launch`: start the workers of one node with torch's elastic agent, used as a library.

Node 0 hosts the rendezvous store on `master_addr:master_port`; every node checks in there first, so a node
that never arrives is reported as "expected N nodes, K arrived" instead of a silent hang, and a port that is
already taken is named before anything starts. Workers run through `meshkit.worker`, which records each
rank's exception for the agent, so a failing rank's error is shown by name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from meshkit.config import LaunchSettings, RunConfig
from meshkit.errors import MeshkitError
from meshkit.resolve import ENV_CONFIG_FILE, ENV_LAUNCH_FLAGS, launch_flags_to_env

MULTI_NODE_DEFAULT_PORT = 29500
RUN_ID_ENV = "MESHKIT_RUN_ID"


class LaunchError(MeshkitError):
    """The job could not start or finish; the message names the cause."""


@dataclass(frozen=True)
class LaunchTarget:
    """What each worker runs: a script path or (module=True) a module name, with its arguments."""

    program: str
    args: tuple[str, ...] = ()
    module: bool = False

    def check(self) -> None:
        if self.module:
            if importlib.util.find_spec(self.program) is None:
                raise LaunchError(f"module '{self.program}' was not found: check the name, or drop -m for a script")
        elif not Path(self.program).is_file():
            raise LaunchError(f"script '{self.program}' does not exist")

    def worker_args(self) -> list[str]:
        return ["-u", "-m", "meshkit.worker", *(["-m"] if self.module else []), self.program, *self.args]


@dataclass(frozen=True)
class LaunchPlan:
    """The resolved settings the launcher needs, plus what the workers must inherit."""

    settings: LaunchSettings
    threads_per_process: int | None = None
    device: str = "auto"
    config_file: str | None = None
    flags: Mapping[str, Any] = field(default_factory=dict)
    flag_labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: RunConfig, **kwargs: Any) -> LaunchPlan:
        return cls(config.launch, config.threads_per_process, config.device, **kwargs)

    @property
    def port(self) -> int:
        if self.settings.master_port is not None:
            return self.settings.master_port
        return MULTI_NODE_DEFAULT_PORT if self.settings.nnodes > 1 else 0  # 0: any free port

    def worker_env(self) -> dict[str, str]:
        """Variables for the agent (this process) and the workers it starts."""
        env = {
            ENV_LAUNCH_FLAGS: launch_flags_to_env(self.flags, self.flag_labels),
            # A store shared between the rendezvous and the workers keeps the previous attempt's keys, so
            # restarted workers read dead peers' addresses (pytorch/pytorch#135712): one store per attempt.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        if self.config_file:
            env[ENV_CONFIG_FILE] = str(Path(self.config_file).resolve())
        if torch.cuda.is_available():
            # NCCL's flight recorder: on a collective timeout every rank dumps its last collectives (what it
            # waited in, with sequence numbers) for `torch.distributed.flight_recorder` to compare.
            for name, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")):
                if name not in os.environ:
                    env[name] = value
        if "OMP_NUM_THREADS" not in os.environ:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            threads = self.threads_per_process or max(1, cores // self.settings.nproc_per_node)
            env["OMP_NUM_THREADS"] = str(threads)
        return env


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


def open_rendezvous_store(settings: LaunchSettings, port: int, run_id: str) -> tuple[TCPStore, str]:
    """Node 0 binds the store (naming the port if it is taken); other nodes connect within the timeout.

    The store is multi-tenant: the agent's own c10d rendezvous reuses this server in the same process.
    Returns the store and the key counting the nodes that arrived.
    """
    addr, timeout = settings.master_addr, timedelta(seconds=settings.rdzv_timeout_s)
    is_host = settings.node_rank == 0
    try:
        store = TCPStore(addr, port, is_master=is_host, multi_tenant=True, timeout=timeout)
    except (RuntimeError, ValueError, TimeoutError) as err:
        if is_host:
            raise LaunchError(
                f"port {port} is in use on this host (or cannot be bound): choose another with --master-port"
            ) from err
        raise LaunchError(
            f"node {settings.node_rank} could not reach node 0 at {addr}:{port} within {settings.rdzv_timeout_s:g}s: "
            "start node 0 first and check --master-addr/--master-port"
        ) from err
    arrived_key = f"meshkit/{run_id}/arrived"
    store.add(arrived_key, 1)
    return store, arrived_key


def root_cause(failures: Mapping[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The failure recorded first. The agent orders by whole-second timestamps, which ties when a rank's error
    makes its peers fail at once (e.g. a broken connection); the error files' modification times do not."""

    def recorded_at(item: tuple[int, ProcessFailure]) -> tuple[int, int]:
        rank, failure = item
        if _recorded(failure):
            return os.stat(failure.error_file).st_mtime_ns, rank
        return failure.timestamp * 10**9 + 10**9 - 1, rank  # no file (killed): after the recorded ones

    return min(failures.items(), key=recorded_at)


def _recorded(failure: ProcessFailure) -> bool:
    return bool(failure.error_file) and os.path.isfile(failure.error_file)


def describe_failure(rank: int, failure: ProcessFailure) -> str:
    """'rank 1 (local rank 1, exit code 1): ValueError: boom' (the rank's full traceback is in its output).

    A rank that recorded an exception is described by it even if the agent's SIGTERM ended it before it
    could exit by itself.
    """
    if not _recorded(failure):
        if failure.exitcode < 0:
            return f"rank {rank} (local rank {failure.local_rank}) was killed by signal {failure.signal_name()}"
        return f"rank {rank} (local rank {failure.local_rank}, exit code {failure.exitcode}): it recorded no error"
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"stopped by {failure.signal_name()}"
    return f"rank {rank} (local rank {failure.local_rank}, {how}): {message}"


def launch(target: LaunchTarget, plan: LaunchPlan) -> int:
    """Run `target` on this node's workers; returns the job's exit code (0 when every rank succeeded)."""
    target.check()
    settings = plan.settings
    run_id = os.environ.get(RUN_ID_ENV, "meshkit")
    store, arrived_key = open_rendezvous_store(settings, plan.port, run_id)
    port = store.port
    numa = None
    if torch.cuda.is_available():
        from torch.numa.binding import AffinityMode, NumaOptions

        numa = NumaOptions(affinity_mode=AffinityMode.NODE, should_fall_back_if_binding_fails=True)
    config = LaunchConfig(
        min_nodes=settings.min_nnodes or settings.nnodes,
        max_nodes=settings.nnodes,
        nproc_per_node=settings.nproc_per_node,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"{settings.master_addr}:{port}",
        rdzv_configs={
            "is_host": settings.node_rank == 0,
            "join_timeout": max(1, int(settings.rdzv_timeout_s)),
            "last_call_timeout": max(1, int(settings.rdzv_last_call_s)),
        },
        max_restarts=settings.max_restarts,
        logs_specs=DefaultLogsSpecs(),
        numa_options=numa,
    )
    try:
        with _environment(plan.worker_env()):
            launch_agent(config, sys.executable, target.worker_args())
    except ChildFailedError as err:
        rank, first = root_cause(err.failures)
        # Ranks stopped by the agent after the first failure end by signal; only real failures are listed.
        others = sorted(r for r, f in err.failures.items() if r != rank and (f.exitcode > 0 or _recorded(f)))
        also = f"; also failed: rank {', '.join(map(str, others))}" if others else ""
        print(f"meshkit launch: {describe_failure(rank, first)}{also}", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 1
    except RendezvousTimeoutError:
        arrived = store.add(arrived_key, 0)
        low = settings.min_nnodes or settings.nnodes
        expected = settings.nnodes if low == settings.nnodes else f"at least {low}"
        print(
            f"meshkit launch: rendezvous at {settings.master_addr}:{port} timed out after "
            f"{settings.rdzv_timeout_s:g}s: expected {expected} nodes, {arrived} arrived",
            file=sys.stderr,
        )
        return 1
    finally:
        del store
    return 0
