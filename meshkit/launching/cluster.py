"""What a cluster scheduler already says about a launch: SLURM (`srun meshkit launch ...`, one launcher per node)
and a Kubeflow PyTorchJob (one launcher per pod). `meshkit launch` and `meshkit train` take these as the
`launch.*` settings of the environment level — above the config file, below `MESHKIT_*` variables and flags — so
that a job script needs no flags; `meshkit config show` names the variable behind each value.

The variables are read by the launcher only: its workers get torch's own RANK / WORLD_SIZE, which mean ranks there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from meshkit.core.errors import MeshkitError


class ClusterEnvError(MeshkitError):
    """A scheduler's environment that does not describe one launcher per node."""


_GROUP = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?")


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list: 'gpu[01-03,07],login1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']."""
    hosts: list[str] = []
    for prefix, ranges in _GROUP.findall(text.replace(" ", "")):
        prefix = prefix.lstrip(",")
        if not ranges:
            if prefix:
                hosts.append(prefix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not high:
                hosts.append(prefix + low)
                continue
            hosts += [prefix + str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return hosts


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").split("(")[0]  # SLURM writes '8(x2)' for repeated counts
    return int(value) if value.isdigit() else None


def slurm_settings(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Inside an srun step: nodes, this node's rank, the first node as master, its GPUs as processes per node."""
    if "SLURM_STEP_ID" not in env or "SLURM_NODEID" not in env:
        return {}
    nodes = _int(env, "SLURM_STEP_NUM_NODES") or _int(env, "SLURM_NNODES") or 1
    tasks = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
    if tasks is not None and tasks != nodes:
        raise ClusterEnvError(
            f"srun started {tasks} tasks on {nodes} node(s), but meshkit launch starts a node's processes itself: "
            "run one task per node (srun --ntasks-per-node=1 meshkit launch ...)"
        )
    found: dict[str, tuple[Any, str]] = {
        "launch.nnodes": (nodes, "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"),
        "launch.node_rank": (int(env["SLURM_NODEID"]), "SLURM_NODEID"),
    }
    hostlist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if v in env), None)
    if nodes > 1 and hostlist_var:
        hosts = expand_hostlist(env[hostlist_var])
        if hosts:
            found["launch.master_addr"] = (hosts[0], hostlist_var)
    gpus = _int(env, "SLURM_GPUS_ON_NODE")
    if gpus:
        found["launch.nproc_per_node"] = (gpus, "SLURM_GPUS_ON_NODE")
    return found


def pytorchjob_settings(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """A Kubeflow PyTorchJob pod: the PET_* variables (torchrun style) when present, else MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE (pods) and RANK (this pod's index)."""
    found: dict[str, tuple[Any, str]] = {}
    if "PET_NNODES" in env:
        low, _, high = env["PET_NNODES"].partition(":")
        found["launch.nnodes"] = (int(high or low), "PET_NNODES")
        if high:
            found["launch.min_nnodes"] = (int(low), "PET_NNODES")
        for key, name in (("launch.node_rank", "PET_NODE_RANK"), ("launch.nproc_per_node", "PET_NPROC_PER_NODE")):
            if env.get(name, "").isdigit():
                found[key] = (int(env[name]), name)
        for key, name in (("launch.master_addr", "PET_MASTER_ADDR"), ("launch.master_port", "PET_MASTER_PORT")):
            if env.get(name):
                found[key] = (int(env[name]) if key.endswith("port") else env[name], name)
        return found
    if not ({"MASTER_ADDR", "WORLD_SIZE", "RANK"} <= set(env) and "KUBERNETES_SERVICE_HOST" in env):
        return {}
    found["launch.nnodes"] = (int(env["WORLD_SIZE"]), "WORLD_SIZE")
    found["launch.node_rank"] = (int(env["RANK"]), "RANK")
    found["launch.master_addr"] = (env["MASTER_ADDR"], "MASTER_ADDR")
    if env.get("MASTER_PORT", "").isdigit():
        found["launch.master_port"] = (int(env["MASTER_PORT"]), "MASTER_PORT")
    return found


def cluster_settings(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """({launch key: value}, {launch key: 'env SLURM_NODEID (SLURM)'}) from this launcher's environment."""
    for scheduler, read in (("SLURM", slurm_settings), ("PyTorchJob", pytorchjob_settings)):
        found = read(env)
        if found:
            values = {key: value for key, (value, _) in found.items()}
            return values, {key: f"env {name} ({scheduler})" for key, (_, name) in found.items()}
    return {}, {}
