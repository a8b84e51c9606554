"""Full weights out to the ecosystem: safetensors shards plus `model.safetensors.index.json` (HF layout).

Every file is written under a temporary name, fsynced and renamed into place, and the index is written last,
so an interrupted export never leaves an index pointing at half-written shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912; ints are bytes."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"size {size!r} is not a byte count like 500MB, 2GB or 1GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def storage_identity(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """Equal for two names of the same tensor (tied weights)."""
    return (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape), tensor.stride())


def unique_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; names that alias an earlier tensor (tied weights) are dropped."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        identity = storage_identity(tensor)
        if tensor.device.type != "meta" and identity in seen:
            continue
        seen.add(identity)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


@dataclass(frozen=True)
class TensorInfo:
    """A tensor to export, known before its values are: name, full shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(tensors: list[TensorInfo], max_shard_bytes: int) -> list[list[TensorInfo]]:
    """Greedy split in the given order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorInfo]] = [[]]
    used = 0
    for info in tensors:
        if shards[-1] and used + info.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(info)
        used += info.nbytes
    return shards


def plain_numbers(value: Any) -> Any:
    """`value` with every 0-d tensor inside (dicts, lists, tuples) as a Python number, for JSON (torchao keeps an
    optimizer's learning rate as a tensor, and so schedulers' saved rates are tensors too)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    if isinstance(value, Mapping):
        return {key: plain_numbers(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_numbers(item) for item in value)
    return value


def write_atomically(path: Path, tensors: dict[str, torch.Tensor] | None = None, text: str | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if tensors is not None:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    else:
        tmp.write_text(text or "")
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    follow_umask(tmp)
    os.replace(tmp, path)


def follow_umask(path: str | os.PathLike[str]) -> None:
    """Give a file written through a private route (safetensors writes 0600, `mkstemp` creates 0600) the mode an
    ordinary file gets under the process's umask (0644 under 022), so the people and services it is for can read
    it."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    try:  # (Linux says it without changing it)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


class ShardStream:
    """Writes a planned export one shard at a time: `add` the tensors in plan order; each shard is written
    (atomically) as soon as its last tensor arrives and then dropped, so at most one shard is held.
    `close()` writes the index last, so an interrupted export never has an index naming missing shards."""

    def __init__(self, out_dir: str | os.PathLike[str], plan: list[list[TensorInfo]]) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.plan = [shard for shard in plan if shard] or [[]]
        count = len(self.plan)
        self.names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        self._shard = 0
        self._pending: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.plan[self._shard][len(self._pending)]
        if name != expected.name or tuple(tensor.shape) != expected.shape:
            raise ValueError(f"export: got {name} {tuple(tensor.shape)}, expected {expected.name} {expected.shape}")
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        if len(self._pending) == len(self.plan[self._shard]):
            self._flush()

    def _flush(self) -> None:
        file_name = self.names[self._shard]
        write_atomically(self.out / file_name, tensors=self._pending)
        self.weight_map.update(dict.fromkeys(self._pending, file_name))
        self._pending = {}
        self._shard += 1

    def close(self) -> Path:
        if self._shard < len(self.plan):
            if self._pending or not self.plan[self._shard]:
                self._flush()
            if self._shard < len(self.plan):
                raise ValueError(f"export: {len(self.plan) - self._shard} shard(s) were never completed")
        total = sum(info.nbytes for shard in self.plan for info in shard)
        index = {"metadata": {"total_size": total}, "weight_map": self.weight_map}
        write_atomically(self.out / INDEX_NAME, text=json.dumps(index, indent=2, sort_keys=True))
        for stale in self.out.glob("model*.safetensors"):
            if stale.name not in self.names:
                stale.unlink()  # a shard of an earlier export with a different shard count
        return self.out / INDEX_NAME


def save_safetensors(
    state_dict: Mapping[str, torch.Tensor], out_dir: str | os.PathLike[str], max_shard_size: int | str = "2GB"
) -> Path:
    """Write `state_dict` as safetensors shards and an index; returns the index path."""
    tensors = unique_tensors(state_dict)
    infos = [TensorInfo(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    stream = ShardStream(out_dir, plan_shards(infos, parse_size(max_shard_size)))
    for shard in stream.plan:
        for info in shard:
            stream.add(info.name, tensors[info.name])
    return stream.close()


def state_dict_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of names, dtypes, shapes and bytes in sorted key order: equal weights give equal digests."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
