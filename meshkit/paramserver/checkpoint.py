"""Parameter-server checkpoints: each server writes its parameters and optimizer state by parameter name, each
worker its data position and random state; one worker commits. Loading reads by name, so a checkpoint saved
with some number of servers loads into any other.

Files (covered by the manifest, so `latest`/`verify` treat them like every other checkpoint):
    ps-server-00000.safetensors   model.<name> and optimizer.<name>.<key> tensors of server rank 0
    rank-00000.json               server rank 0: names it held, clocks, version, optimizer scalars, schedulers
    rank-00002.json               worker rank 2: its step, data position, random state
    meta.json                     strategy, step, servers, workers, the user's extra
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshkit.checkpoint.extras import rng_state
from meshkit.checkpoint.storage import META, CheckpointError, rank_file, read_record, write_json, write_manifest
from meshkit.core.io import follow_umask

STRATEGY = "parameter_server"


def shard_file(rank: int) -> str:
    return f"ps-server-{rank:05d}.safetensors"


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)


def write_server_shard(
    directory: Path,
    rank: int,
    named: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    schedulers: list[Any],
    progress: dict[str, Any],
) -> None:
    """This server's parameters, optimizer state and schedulers; `progress` holds its clocks and version."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, param in named:
        tensors[f"model.{name}"] = param.detach().to("cpu").contiguous()
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{name}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(name, {})[key] = _jsonable(value)
    path = directory / shard_file(rank)
    save_file(tensors, str(path))
    follow_umask(path)
    groups = [{k: _jsonable(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    record = {
        "role": "server",
        "names": [name for name, _ in named],
        "param_groups": groups,
        "optimizer_scalars": scalars,
        "schedulers": [s.state_dict() for s in schedulers],
        **progress,
    }
    write_json(directory / rank_file(rank), record)


def write_worker_file(directory: Path, rank: int, index: int, clock: int, loaders: list[dict[str, Any]]) -> None:
    record = {"role": "worker", "worker_index": index, "clock": clock, "loaders": loaders, "rng": rng_state()}
    write_json(directory / rank_file(rank), record)


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """The last files of a save: meta.json and the manifest (size and checksum of every file)."""
    write_json(directory / META, {"format": 1, "strategy": STRATEGY, **meta})
    write_manifest(directory)


def read_meta(directory: Path) -> dict[str, Any]:
    meta = read_record(directory, META, ("format",))
    if meta.get("strategy") != STRATEGY:
        raise CheckpointError(
            f"checkpoint {directory} was not saved by a parameter-server run: load it with the layout that saved "
            "it (drop strategy=parameter_server)"
        )
    return meta


def _records(directory: Path, role: str) -> list[tuple[int, dict[str, Any]]]:
    """(rank, record) of every rank file of `role`, in rank order."""
    found = []
    for path in sorted(directory.glob("rank-*.json")):
        record = read_record(directory, path.name, ("role",))
        if record.get("role") == role:
            found.append((int(path.stem.split("-")[1]), record))
    return found


def _server_records(directory: Path) -> list[tuple[int, dict[str, Any]]]:
    found = _records(directory, "server")
    if not found:
        raise CheckpointError(f"checkpoint {directory} holds no parameter-server shard")
    return found


def read_server_shard(
    directory: Path,
    named: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    schedulers: list[Any],
) -> dict[str, Any]:
    """Fill this server's parameters and optimizer state from every saved shard that holds them (by name);
    returns the progress record (clocks, version) of the first server."""
    records = _server_records(directory)
    owner = {name: rank for rank, record in records for name in record["names"]}
    missing = [name for name, _ in named if name not in owner]
    if missing:
        raise CheckpointError(
            f"checkpoint {directory} has no weights for {', '.join(missing[:3])}"
            f"{' and more' if len(missing) > 3 else ''}: it was saved from another model"
        )
    by_rank = dict(records)
    state: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for rank in sorted({owner[name] for name, _ in named}):
            with safe_open(str(directory / shard_file(rank)), framework="pt") as handle:
                keys = list(handle.keys())  # noqa: SIM118 - a safetensors handle is not iterable
                for name, param in named:
                    if owner[name] != rank:
                        continue
                    stored = handle.get_tensor(f"model.{name}")
                    if stored.shape != param.shape:
                        raise CheckpointError(
                            f"checkpoint {directory}: {name} has shape {tuple(stored.shape)}, the model's is "
                            f"{tuple(param.shape)}"
                        )
                    param.copy_(stored)
                    prefix = f"optimizer.{name}."
                    entry = {
                        k[len(prefix) :]: handle.get_tensor(k).to(param.device) for k in keys if k.startswith(prefix)
                    }
                    state[name] = {**entry, **by_rank[rank]["optimizer_scalars"].get(name, {})}
    for name, param in named:
        if state[name]:
            optimizer.state[param] = state[name]
    first = records[0][1]
    for group, saved in zip(optimizer.param_groups, first["param_groups"], strict=False):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    for scheduler, saved in zip(schedulers, first["schedulers"], strict=False):
        scheduler.load_state_dict(saved)
    return {k: first[k] for k in ("clocks", "version", "steps") if k in first}


def read_server_schedulers(directory: Path) -> list[dict[str, Any]]:
    """The schedulers' states as the first server saved them (every server steps the same schedules), for the
    workers' own copies of the user's schedulers."""
    records = _records(directory, "server")
    return records[0][1].get("schedulers", []) if records else []


def read_worker_file(directory: Path, index: int) -> dict[str, Any] | None:
    """The record of the worker with this index (its data position and random state); a worker the saving run
    did not have takes the first worker's data position and keeps its own random state."""
    by_index = {record.get("worker_index"): record for _, record in _records(directory, "worker")}
    if index in by_index:
        return by_index[index]
    return {**by_index[0], "rng": None} if 0 in by_index else None
