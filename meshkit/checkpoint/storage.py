"""Files of one checkpoint directory, and how they are written and checked.

    shard-0000R-model-00001-of-00001.safetensors   each writing rank's tensors (torch.distributed.checkpoint,
                                                   Hugging Face storage: safetensors + offsets in its header)
    rank-0000R.json                                each rank's RNG states and data position
    meta.json                                      step, layout, optimizer settings, scheduler and scaler state
    manifest.json                                  size and sha256 of every other file (written last)

Nothing here is pickled: tensors are safetensors, everything else JSON. The manifest is checked before a
load reads anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshkit.core.errors import MeshkitError

MANIFEST = "manifest.json"
META = "meta.json"
FORMAT_VERSION = 1
# What a save writes; anything else in a checkpoint directory (an NFS `.nfsXXXX` file, an editor's backup, a
# user's note) is not meshkit's: left out of the manifest, and reported instead of failing the checkpoint.
_WRITTEN = re.compile(r"^(?!\.).*\.safetensors$|^rank-\d+\.json$|^" + re.escape(META) + "$")


class UnknownFilesWarning(UserWarning):
    """A checkpoint directory holds files meshkit did not write; they are ignored."""


def written_by_save(name: str) -> bool:
    return bool(_WRITTEN.match(name))


class CheckpointError(MeshkitError):
    """A checkpoint that cannot be used; the message names it and what is wrong."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def write_json(path: Path, data: Any) -> None:
    """Write, flush and fsync: once this returns the bytes are on disk."""
    with path.open("w") as handle:
        json.dump(data, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_entries(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and checksum of each named file, after fsyncing it."""
    entries = {}
    for name in names:
        path = directory / name
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
        entries[name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    return entries


def write_manifest(directory: Path, known: dict[str, dict[str, Any]] | None = None) -> None:
    """Record every file's size and checksum (`known`: entries other ranks computed), then fsync the directory."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and written_by_save(p.name))
    known = {name: entry for name, entry in (known or {}).items() if name in names}
    files = dict(sorted({**known, **file_entries(directory, [name for name in names if name not in known])}.items()))
    write_json(directory / MANIFEST, {"format": FORMAT_VERSION, "files": files, "checksum": _entries_checksum(files)})
    fsync_dir(directory)


def _entries_checksum(files: Any) -> str:
    """The manifest's own checksum, of its entries: a damaged manifest is told apart from a damaged file."""
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_entries(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifest's entries (name -> size, sha256), or a one-line CheckpointError naming the manifest where it
    is unreadable or damaged: a field missing or misnamed, a value of the wrong kind, entries that do not match the
    manifest's own checksum (checkpoints written before it had one are checked entry by entry)."""
    path = directory / MANIFEST
    damaged = f"checkpoint {directory}: {MANIFEST} is damaged"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} is unreadable ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{damaged}: it has no 'files' table")
    unknown = sorted(set(manifest) - {"format", "files", "checksum"})
    if unknown:
        raise CheckpointError(f"{damaged}: it has a field it never writes ({unknown[0]!r})")
    files = manifest["files"]
    if "checksum" in manifest and manifest["checksum"] != _entries_checksum(files):
        raise CheckpointError(f"{damaged}: its entries do not match its own checksum")
    for name, entry in files.items():
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            raise CheckpointError(f"{damaged}: the entry of {name} is not a size and a sha256")
        if not isinstance(entry["size"], int) or not isinstance(entry["sha256"], str):
            raise CheckpointError(f"{damaged}: the entry of {name} has a size or sha256 of the wrong kind")
    return files


def read_record(directory: Path, name: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """A JSON record of the checkpoint (meta.json, a rank's file) with the fields a load reads, or a one-line
    CheckpointError naming that file."""
    try:
        record = json.loads((directory / name).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {directory}: {name} is unreadable ({err})") from None
    missing = [field for field in fields if not isinstance(record, dict) or field not in record]
    if missing:
        raise CheckpointError(f"checkpoint {directory}: {name} is damaged: it has no {missing[0]!r}")
    return record


def verify(directory: Path) -> None:
    """Raise CheckpointError unless every file the manifest lists is present, of its size and checksum.
    Files the manifest does not list are reported (UnknownFilesWarning) and ignored."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}: it was not completely written")
    files = manifest_entries(directory)
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory}: {name} is missing")
        if path.stat().st_size != expected["size"]:
            raise CheckpointError(
                f"checkpoint {directory}: {name} has {path.stat().st_size} bytes, the manifest says {expected['size']}"
            )
        if sha256(path) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {name} does not match its checksum")
    listed = set(files) | {MANIFEST}
    unlisted = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in listed)
    if unlisted:
        more = f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
        warnings.warn(
            f"checkpoint {directory}: ignoring files it did not write: {', '.join(unlisted[:3])}{more}",
            UnknownFilesWarning,
            stacklevel=2,
        )


def writer(directory: Path) -> HuggingFaceStorageWriter:
    return HuggingFaceStorageWriter(str(directory), save_distributed=True)


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path, group: dist.ProcessGroup | None) -> None:
    """Every rank writes its pieces (replicated tensors once, by the lowest rank holding them)."""
    dcp.save(tensors, storage_writer=writer(directory), process_group=group, no_dist=not dist.is_initialized())


def stored_shapes(directory: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (full shape, dtype) of every tensor in the checkpoint (read from the safetensors headers)."""
    metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    return {
        key: (md.size, md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def load_tensors(
    targets: dict[str, torch.Tensor], directory: Path, group: dist.ProcessGroup | None, *, alone: bool = False
) -> None:
    """Fill `targets` in place, each with exactly the piece its layout holds.

    Collective over `group` unless `alone` (one process reading for itself, e.g. an offline export).
    """
    alone = alone or not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # intended when alone
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(directory)), process_group=group, no_dist=alone)
