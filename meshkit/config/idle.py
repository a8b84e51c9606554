"""Values a person set that change nothing in this run: one notice line each, and the run goes on.

A rule names keys, when the run leaves them unused (a test on the resolved config) and why. Only values a person
chose count: a default, a derived value, or a value a scheduler's variables gave (SLURM, PyTorchJob) passes
silently. The launcher prints the notices before its workers start; an Engine prints those whose values came
from code (no launcher saw them), and every one when no meshkit launcher started it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from meshkit.config.schema import RunConfig

UNCHOSEN = ("default", "derived from other settings")
SCHEDULERS = ("(SLURM)", "(PyTorchJob)")
ELASTIC_ONLY = ("master_addr", "master_port", "node_rank", "local_addr", "min_nnodes", "rdzv_last_call_s")
RAY_ONLY = ("ray_address", "ray_num_workers", "ray_cpus_per_worker", "ray_gpus_per_worker", "ray_placement")


@dataclass(frozen=True)
class IdleRule:
    keys: tuple[str, ...]
    idle: Callable[[RunConfig], bool]
    why: str


def _one_node(config: RunConfig) -> bool:
    launch = config.launch
    return launch.backend == "elastic" and launch.nnodes == 1 and (launch.min_nnodes or 1) == 1


def _keys(section: str, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{section}.{name}" for name in names)


RULES = (
    IdleRule(
        _keys("launch", ("master_addr", "local_addr")),
        _one_node,
        "on one node: its ranks meet on loopback (it is used with nnodes > 1)",
    ),
    IdleRule(
        _keys("launch", ELASTIC_ONLY),
        lambda c: c.launch.backend == "ray",
        "under launch.backend=ray: Ray places the ranks and rank 0's node hosts the job's store",
    ),
    IdleRule(_keys("launch", RAY_ONLY), lambda c: c.launch.backend != "ray", "without launch.backend=ray"),
    IdleRule(("sharding.offload_dir",), lambda c: c.sharding.offload != "nvme", "without sharding.offload=nvme"),
    IdleRule(
        _keys("tensor_parallel", ("sequence_parallel", "loss_parallel", "plan")),
        lambda c: c.parallel.tp == 1,
        "with parallel.tp=1 (no tensor parallelism)",
    ),
    IdleRule(
        _keys("pipeline", ("schedule", "microbatches", "stages_per_rank")),
        lambda c: c.parallel.pp == 1,
        "with parallel.pp=1 (no pipeline)",
    ),
    IdleRule(
        _keys("compile", ("backend", "mode", "fullgraph", "dynamic", "regional")),
        lambda c: not c.compile.enabled,
        "with compile.enabled=false",
    ),
    IdleRule(
        ("activation_checkpointing.every",),
        lambda c: c.activation_checkpointing.mode == "none",
        "with activation_checkpointing.mode=none",
    ),
    IdleRule(
        _keys("ps", ("servers", "mode", "max_staleness", "staleness_lr")),
        lambda c: c.strategy != "parameter_server",
        "without strategy=parameter_server",
    ),
    IdleRule(("moe.capacity_factor",), lambda c: c.parallel.ep == 1, "with parallel.ep=1 (the model routes itself)"),
    IdleRule(
        _keys("probe", ("top_k", "steps", "memory_limit_gb")),
        lambda c: c.layout != "auto",
        "without layout=auto",
    ),
)


def chosen_by_a_person(source: str) -> bool:
    return source not in UNCHOSEN and not source.endswith(SCHEDULERS)


def idle_values(config: RunConfig, sources: Mapping[str, str], only_from: tuple[str, ...] = ()) -> list[str]:
    """One notice per value a person chose that this run leaves unused; `only_from`: sources starting with one of
    these (e.g. ("code",)), else every source."""
    notes = []
    for rule in RULES:
        if not rule.idle(config):
            continue
        for key in rule.keys:
            source = sources.get(key, "default")
            if not chosen_by_a_person(source) or (only_from and not source.startswith(only_from)):
                continue
            section, _, name = key.partition(".")
            value = getattr(getattr(config, section), name)
            notes.append(f"{key.removeprefix('launch.')}={value} ({source}) has no effect {rule.why}")
    return notes
