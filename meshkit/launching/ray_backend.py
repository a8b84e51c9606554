"""`launch.backend: ray`: the job's ranks on a Ray cluster, started from one driver.

Ray places the ranks: a placement group of one bundle per rank (`launch.ray_cpus_per_worker` CPUs and
`launch.ray_gpus_per_worker` GPUs, `launch.ray_placement` strategy) on the cluster at `launch.ray_address`
(`auto`, `ray://host:10001`), or on a local cluster started for the run. In each bundle a `RankHost` actor runs
meshkit's worker bootstrap as its child with the environment meshkit's own launcher gives (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR = rank 0's node, the config file and launch flags, threads, allocator settings), so
`meshkit launch`, `meshkit train` and `meshkit finetune` run the same workers with the same config precedence.
The driver prints the ranks' output as it comes (progress, summary and trackers report from rank 0 as before).

Faults: the first rank to fail (or to be lost with its actor or node) is named in one line, as by the elastic
launcher; the others are stopped after `launch.stop_grace_s`. Then the whole group starts again, up to
`launch.max_restarts` times (the gang restart Ray Train's `FailureConfig(max_failures)` does), and a run with
`checkpoint.resume: auto` resumes from its last checkpoint: `checkpoint.dir` must be storage every node sees.

Why actors in a placement group and not Ray Train's `TorchTrainer`: TorchTrainer runs the training function in a
thread of its actor and sets up torch's process group there itself; meshkit's worker is a whole process that owns
its process group, its store, its signals (preemption) and its error file, and prints its own progress. Actors
that start that process keep the worker identical under both backends; Ray still places, isolates GPUs and
notices lost nodes.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from meshkit.config.resolve import ENV_LAUNCHER_THREADS
from meshkit.core.errors import MeshkitError, one_line
from meshkit.launching.failures import describe_failure, failure_report
from meshkit.launching.job import LaunchPlan, LaunchTarget
from meshkit.launching.ray_rank import Placement, Progress, RankHost
from meshkit.launching.stores import WILDCARD, Addresses
from meshkit.launching.worker import LAUNCH_LOG_ENV

POLL_S = 0.1
ANSWER_S = 60.0  # an actor that does not answer within this is taken for lost with its node
RAY_MISSING = "launch.backend=ray needs Ray: pip install 'meshkit[ray]' (or pip install ray)"


class RayLaunchError(MeshkitError):
    """The job could not be placed on the Ray cluster; the message names the cause."""


# Ray binds its GCS, raylets and workers to 127.0.0.1 alone when this switch is off (read once, when ray is first
# imported); a cluster that meshkit starts for one run on this machine needs no port open to the network.
RAY_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray(loopback_only: bool = False) -> Any:
    """Import ray; with `loopback_only`, a cluster it starts on this machine listens on 127.0.0.1 only."""
    if loopback_only and "ray" not in sys.modules:
        os.environ[RAY_LOOPBACK_SWITCH] = "0"
    try:
        import ray
    except ImportError:
        raise RayLaunchError(RAY_MISSING) from None
    return ray


@dataclass(frozen=True)
class Rank:
    """One placed rank: its global and local rank, its node's index and where its actor sits."""

    rank: int
    local_rank: int
    node_rank: int
    local_world: int
    placement: Placement


def assign_ranks(placements: Sequence[Placement]) -> list[tuple[int, Rank]]:
    """(actor index, Rank) in global-rank order: nodes in order of first appearance, within a node by GPU id
    (local rank i uses its node's i-th visible GPU) then actor order; ranks fill node by node."""
    nodes: dict[str, list[int]] = {}
    for index, placement in enumerate(placements):
        nodes.setdefault(placement.node_id, []).append(index)
    ranked: list[tuple[int, Rank]] = []
    for node_rank, members in enumerate(nodes.values()):
        members.sort(key=lambda i: (tuple(int(g) if g.isdigit() else g for g in placements[i].gpu_ids), i))
        for local_rank, index in enumerate(members):
            rank = Rank(len(ranked), local_rank, node_rank, len(members), placements[index])
            ranked.append((index, rank))
    return ranked


def rank_env(rank: Rank, world: int, master: Placement, attempt: int, plan: LaunchPlan, node_gpus: str) -> dict:
    """What meshkit's elastic launcher gives a worker, for this rank on its Ray node."""
    settings = plan.settings
    bind = WILDCARD if settings.bind_all_interfaces else master.address
    env = plan.worker_env(Addresses(bind, master.address), include_interface=False)
    env.update(
        {
            "RANK": str(rank.rank),
            "LOCAL_RANK": str(rank.local_rank),
            "GROUP_RANK": str(rank.node_rank),
            "ROLE_RANK": str(rank.rank),
            "WORLD_SIZE": str(world),
            "ROLE_WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(rank.local_world),
            "ROLE_NAME": "default",
            "MASTER_ADDR": master.address,
            "MASTER_PORT": str(master.port),
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(settings.max_restarts),
            "TORCHELASTIC_RUN_ID": os.environ.get("MESHKIT_RUN_ID", "meshkit"),
        }
    )
    if "OMP_NUM_THREADS" not in os.environ and plan.threads_per_process is None:
        env["OMP_NUM_THREADS"] = env[ENV_LAUNCHER_THREADS] = str(max(1, int(settings.ray_cpus_per_worker)))
    if LAUNCH_LOG_ENV in env:  # where a rank that lost a peer leaves its traceback, on its own node
        env[LAUNCH_LOG_ENV] = str(Path(env[LAUNCH_LOG_ENV]).with_name(f"ray-node{rank.node_rank}.log"))
    if node_gpus:  # every rank of a node sees the node's GPUs of this job: LOCAL_RANK picks its own
        env["CUDA_VISIBLE_DEVICES"] = node_gpus
    env.update({name: value for name, value in os.environ.items() if name.startswith("MESHKIT_") and name not in env})
    return env


def gpus_per_worker(plan: LaunchPlan, ray: Any) -> float:
    chosen = plan.settings.ray_gpus_per_worker
    if chosen is not None:
        return chosen
    if plan.device == "cuda":
        return 1.0
    if plan.device == "auto":
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    return 0.0


class RayJob:
    """One run of the job on the cluster: attempts until one succeeds or restarts are used up."""

    def __init__(self, target: LaunchTarget, plan: LaunchPlan, ray: Any) -> None:
        self.target, self.plan, self.ray = target, plan, ray
        self.world = plan.settings.world_size
        self.gpus = gpus_per_worker(plan, ray)
        self.cwd = os.getcwd()
        self.records = Path(tempfile.mkdtemp(prefix="meshkit-ray-"))
        self.clock = ExitTimes()

    def run(self) -> int:
        restarts = self.plan.settings.max_restarts
        for attempt in range(restarts + 1):
            failed = self.attempt(attempt, last=attempt == restarts)
            if failed is None:
                return 0
            line, code = failed
            if attempt < restarts:
                print(f"meshkit launch: {line}; restarting every rank ({attempt + 1} of {restarts})",
                      file=sys.stderr, flush=True)  # fmt: skip
                continue
            print(f"meshkit launch: {line}", file=sys.stderr, flush=True)
            return code
        return 1

    def attempt(self, attempt: int, last: bool) -> tuple[str, int] | None:
        """Place and run every rank once; None on success, else (the report line, exit code)."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        settings = self.plan.settings
        self.clock = ExitTimes()
        bundle = {"CPU": settings.ray_cpus_per_worker, **({"GPU": self.gpus} if self.gpus else {})}
        group = placement_group([dict(bundle) for _ in range(self.world)], strategy=settings.ray_placement)
        actors: list[Any] = []
        try:
            self._wait_placed(group, bundle)
            host = self.ray.remote(RankHost)
            actors += [
                host.options(
                    num_cpus=settings.ray_cpus_per_worker,
                    num_gpus=self.gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
                ).remote()
                for i in range(self.world)
            ]
            placements = self.ray.get([actor.place.remote() for actor in actors])
            ranked = assign_ranks(placements)
            master = ranked[0][1].placement
            gpus_by_node: dict[str, list[str]] = {}
            for _, rank in ranked:
                gpus_by_node.setdefault(rank.placement.node_id, []).extend(rank.placement.gpu_ids)
            ordered = []
            for index, rank in ranked:
                node_gpus = ",".join(gpus_by_node[rank.placement.node_id])
                env = rank_env(rank, self.world, master, attempt, self.plan, node_gpus)
                self.ray.get(
                    actors[index].start.remote(self.target.worker_args(), env, self.cwd, rank.placement.address)
                )
                ordered.append((rank, actors[index]))
            return self._watch(ordered, last)
        finally:
            for actor in actors:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor)
            remove_placement_group(group)

    def _wait_placed(self, group: Any, bundle: dict[str, float]) -> None:
        timeout = self.plan.settings.rdzv_timeout_s
        ready, _ = self.ray.wait([group.ready()], timeout=timeout)
        if not ready:
            have = {k: v for k, v in self.ray.available_resources().items() if k in ("CPU", "GPU")}
            raise RayLaunchError(
                f"the Ray cluster did not place {self.world} rank(s) of {bundle} within {timeout:g}s "
                f"(available now: {have}): lower launch.ray_num_workers or ray_cpus_per_worker, or add nodes"
            )

    def _watch(self, ordered: list[tuple[Rank, Any]], last: bool) -> tuple[str, int] | None:
        """Relay output until every rank exited; stop the rest after the first failure."""
        exits: dict[int, Progress | None] = {}  # rank -> its last progress (None: lost with its actor)
        lost: dict[int, str] = {}  # rank -> why its actor is gone
        stop_at: float | None = None
        while len(exits) < len(ordered):
            # every running rank is asked at once, and answers are awaited together (one round trip per poll)
            asked = {rank.rank: actor.progress.remote() for rank, actor in ordered if rank.rank not in exits}
            answered, _ = self.ray.wait(list(asked.values()), num_returns=len(asked), timeout=ANSWER_S)
            for rank, _actor in ordered:
                if rank.rank in exits:
                    continue
                try:
                    if asked[rank.rank] not in answered:
                        raise TimeoutError(f"its actor did not answer within {ANSWER_S:g}s")
                    progress = self.ray.get(asked[rank.rank])
                except Exception as err:  # the actor or its node is gone (RayActorError, or no answer)
                    exits[rank.rank] = None
                    self.clock.lost(rank.rank)
                    lost[rank.rank] = one_line(f"{type(err).__name__}: {err}")[:160]
                    continue
                sys.stdout.buffer.write(progress.stdout)
                sys.stderr.buffer.write(progress.stderr)
                if progress.exitcode is not None:
                    exits[rank.rank] = progress
            sys.stdout.flush()
            sys.stderr.flush()
            failed = [r for r, p in exits.items() if p is None or p.exitcode != 0]
            if failed and stop_at is None:
                stop_at = time.monotonic() + self.plan.settings.stop_grace_s
                for rank, actor in ordered:
                    if rank.rank not in exits:
                        actor.stop.remote(signal.SIGTERM)
            if stop_at is not None and time.monotonic() >= stop_at:
                for rank, actor in ordered:
                    if rank.rank not in exits:
                        self.clock.killed.add(clock_key(rank.rank))
                        actor.stop.remote(signal.SIGKILL)
                stop_at = float("inf")
            if len(exits) < len(ordered):
                time.sleep(POLL_S)
        if all(p is not None and p.exitcode == 0 for p in exits.values()):
            return None
        failures = {rank.rank: self._failure(rank, exits[rank.rank]) for rank, _ in ordered}
        where = {rank.rank: rank for rank, _ in ordered}

        def describe(number: int, failure: ProcessFailure) -> str:
            if number in lost:
                node = where[number].placement.address
                how = f"was lost with its Ray actor on {node}"
                return f"rank {number} (local rank {failure.local_rank}) {how}: {lost[number]}"
            return describe_failure(number, failure)

        return failure_report(failures, self.plan.settings.max_restarts if last else 0, self.clock, describe)

    def _failure(self, rank: Rank, progress: Progress | None) -> ProcessFailure:
        """The rank's exit as torch's agent would report it (its error record copied to this machine)."""
        pid = clock_key(rank.rank)
        if progress is None:
            return ProcessFailure(rank.local_rank, pid, -int(signal.SIGKILL), "")
        self.clock.exited(pid, progress.exited_at)
        record = ""
        if progress.error_record:
            path = self.records / f"rank-{rank.rank}-{uuid.uuid4().hex[:6]}.json"
            path.write_text(progress.error_record)
            if progress.exited_at is not None:
                os.utime(path, (progress.exited_at, progress.exited_at))
            record = str(path)
        return ProcessFailure(rank.local_rank, pid, progress.exitcode or 0, record)


def clock_key(rank: int) -> int:
    """A rank's key in the exit clock, where the elastic launcher uses pids (a Ray rank's pid is on its node)."""
    return -(rank + 2)


class ExitTimes:
    """The exit clock of a Ray attempt (`failures.ExitClock`): when the driver learnt of each rank's end."""

    def __init__(self) -> None:
        self.killed: set[int] = set()
        self._times: dict[int, float] = {}

    def refresh(self) -> None:
        return None

    def exit_time(self, pid: int) -> float | None:
        return self._times.get(pid)

    def exited(self, pid: int, at: float | None) -> None:
        if at is not None:
            self._times.setdefault(pid, at)

    def lost(self, rank: int) -> None:
        self._times.setdefault(clock_key(rank), time.time())


def launch_on_ray(target: LaunchTarget, plan: LaunchPlan) -> int:
    """Run `target` on every rank of the Ray cluster; returns the job's exit code."""
    target.check()
    settings = plan.settings
    address = settings.ray_address
    cluster_of_its_own = not address and not os.environ.get("RAY_ADDRESS")
    ray = import_ray(loopback_only=cluster_of_its_own)
    started_here = not ray.is_initialized()
    if started_here:
        try:
            local: dict[str, Any] = {}
            if cluster_of_its_own:
                # a new cluster for this run ("local": never one found on this machine) holds the whole job,
                # oversubscribed as under `meshkit launch`
                cores = os.cpu_count() or 1
                local = {"num_cpus": max(cores, math.ceil(settings.world_size * settings.ray_cpus_per_worker))}
                local.update(include_dashboard=False, address="local")
            ray.init(
                **{"address": address or None, **local},
                namespace=f"meshkit-{uuid.uuid4().hex[:8]}",
                log_to_driver=False,
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as err:
            where = f"at {address}" if address else "on this machine"
            raise RayLaunchError(f"could not start or reach a Ray cluster {where}: {one_line(str(err))}") from None
    job = RayJob(target, plan, ray)
    try:
        return job.run()
    finally:
        shutil.rmtree(job.records, ignore_errors=True)
        if started_here:
            ray.shutdown()
