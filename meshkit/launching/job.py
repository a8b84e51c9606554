"""What a launch runs and with what settings: the target, the resolved plan, and the environment the workers
inherit. Shared by both backends (`launch.py`: torch's elastic agent; `ray_backend.py`: a Ray cluster)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshkit.config.resolve import ENV_CONFIG_FILE, ENV_LAUNCH_FLAGS, ENV_LAUNCHER_THREADS, launch_flags_to_env
from meshkit.config.schema import LaunchSettings, RunConfig
from meshkit.core.errors import MeshkitError
from meshkit.launching.interfaces import GLOO_INTERFACE_ENV, gloo_interface
from meshkit.launching.stores import ENV_STORE_BIND, WILDCARD, Addresses
from meshkit.launching.worker import LAUNCH_LOG_ENV, LAUNCHER_PID_ENV
from meshkit.runtime.host_memory import allocator_env

MULTI_NODE_DEFAULT_PORT = 29500
_TORCH_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


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
            try:
                found = importlib.util.find_spec(self.program) is not None
            except (ImportError, ValueError):  # a parent package that does not exist, or an empty name
                found = False
            if not found:
                raise LaunchError(f"module '{self.program}' was not found: check the name, or drop -m for a script")
        elif not Path(self.program).is_file():
            raise LaunchError(f"script '{self.program}' does not exist")

    def worker_args(self) -> list[str]:
        return ["-u", "-m", "meshkit.launching.worker", *(["-m"] if self.module else []), self.program, *self.args]


@dataclass(frozen=True)
class LaunchPlan:
    """The resolved settings the launcher needs, plus what the workers must inherit."""

    settings: LaunchSettings
    threads_per_process: int | None = None
    device: str = "auto"
    preempt_signal: str = "SIGTERM"
    log_dir: Path | None = None  # where `launch-node<N>.log` goes (the launcher's full stderr)
    config_file: str | None = None
    flags: Mapping[str, Any] = field(default_factory=dict)
    flag_labels: Mapping[str, str] = field(default_factory=dict)
    allocator: str | None = "auto"  # the CPU workers' allocator (`runtime/host_memory.py`); None: malloc as is

    @property
    def agent_signals(self) -> str:
        """The signals torch's agent turns into a stop of every worker (its `signals_to_handle`): the preemption
        signal and Ctrl-C's SIGINT are handled by the launcher itself (`_PreemptionHandler`), so they are left
        out."""
        return ",".join(name for name in _TORCH_HANDLED_SIGNALS if name not in self.launcher_signals)

    @property
    def launcher_signals(self) -> tuple[str, ...]:
        """The signals the launcher handles itself: the preemption signal, and SIGINT (Ctrl-C) as that signal —
        a checkpoint where checkpoints are on, one line, exit 130; none when preemption is off."""
        return () if self.preempt_signal == "none" else tuple(dict.fromkeys((self.preempt_signal, "SIGINT")))

    @classmethod
    def from_config(cls, config: RunConfig, **kwargs: Any) -> LaunchPlan:
        return cls(
            config.launch,
            config.threads_per_process,
            config.device,
            config.checkpoint.preempt_signal,
            config.logging.dir,
            **kwargs,
            allocator=config.host_allocator if config.host_memory_slack_mb is not None else None,
        )

    @property
    def port(self) -> int:
        if self.settings.master_port is not None:
            return self.settings.master_port
        return MULTI_NODE_DEFAULT_PORT if self.settings.nnodes > 1 else 0  # 0: any free port

    def worker_env(self, addresses: Addresses, include_interface: bool = True) -> dict[str, str]:
        """Variables for the agent (this process) and the workers it starts. `include_interface` False: the
        caller names the gloo interface on each worker's own node (Ray)."""
        env = {
            ENV_LAUNCH_FLAGS: launch_flags_to_env(self.flags, self.flag_labels),
            # A store shared between the rendezvous and the workers keeps the previous attempt's keys, so
            # restarted workers read dead peers' addresses (pytorch/pytorch#135712): one store per attempt,
            # hosted by global rank 0's worker on this address (`stores.host_worker_store`).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            ENV_STORE_BIND: "" if addresses.bind == WILDCARD else addresses.bind,
            LAUNCHER_PID_ENV: str(os.getpid()),
            # (the agent's signals, for a torch whose LaunchConfig has no `signals_to_handle`: it reads this)
            "TORCHELASTIC_SIGNALS_TO_HANDLE": self.agent_signals,
        }
        # The workers' own connections use the interface of the address this node advertises (on one node:
        # loopback), not the one gloo would pick from the hostname (`interfaces.py`).
        interface = gloo_interface(addresses.advertise, dict(os.environ)) if include_interface else None
        if interface is not None:
            env[GLOO_INTERFACE_ENV] = interface
        if self.config_file:
            env[ENV_CONFIG_FILE] = str(Path(self.config_file).resolve())
        if self.log_dir is not None:  # where a rank that lost a peer leaves its traceback (`worker.py`)
            env[LAUNCH_LOG_ENV] = str((Path(self.log_dir) / f"launch-node{self.settings.node_rank}.log").absolute())
        if torch.cuda.is_available():
            # NCCL's flight recorder: on a collective timeout every rank dumps its last collectives (what it
            # waited in, with sequence numbers) for `torch.distributed.flight_recorder` to compare.
            for name, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")):
                if name not in os.environ:
                    env[name] = value
        on_cpu = self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())
        if self.allocator is not None and on_cpu:
            env.update(allocator_env(os.environ, self.allocator))
        if "OMP_NUM_THREADS" not in os.environ:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            threads = self.threads_per_process or max(1, cores // self.settings.nproc_per_node)
            env["OMP_NUM_THREADS"] = env[ENV_LAUNCHER_THREADS] = str(threads)
        return env
