"""Full weights out to the ecosystem: safetensors shards plus `model.safetensors.index.json` (HF layout).

Every file is written under a temporary name, fsynced and renamed into place, and the index is written last,
so an interrupted export never leaves an index pointing at half-written shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

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


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def unique_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; names that alias an earlier tensor (tied weights) are dropped."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if tensor.device.type != "meta" and identity in seen:
            continue
        seen.add(identity)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def plan_shards(state_dict: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in key order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, tensor in state_dict.items():
        size = _tensor_bytes(tensor)
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor] | None = None, text: str | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if tensors is not None:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    else:
        tmp.write_text(text or "")
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_safetensors(
    state_dict: Mapping[str, torch.Tensor], out_dir: str | os.PathLike[str], max_shard_size: int | str = "2GB"
) -> Path:
    """Write `state_dict` as safetensors shards and an index; returns the index path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = unique_tensors(state_dict)
    shards = plan_shards(tensors, parse_size(max_shard_size))
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for file_name, keys in zip(names, shards, strict=True):
        _write_atomically(out / file_name, tensors={key: tensors[key] for key in keys})
        weight_map.update(dict.fromkeys(keys, file_name))
    total = sum(_tensor_bytes(t) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_atomically(out / INDEX_NAME, text=json.dumps(index, indent=2, sort_keys=True))
    for stale in out.glob("model*.safetensors"):
        if stale.name not in names:
            stale.unlink()  # a shard of an earlier export with a different shard count
    return out / INDEX_NAME


def state_dict_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of names, dtypes, shapes and bytes in sorted key order: equal weights give equal digests."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
