"""Where a fine-tune's records come from, read through Hugging Face `datasets`: a local file (json, jsonl, parquet,
csv, arrow, text), a local directory (its data files, split by name as `datasets` infers them, or a dataset saved
with `save_to_disk`), or a hub dataset name resolved from this machine's caches (a `huggingface-cli download`
snapshot, or `datasets`' own cache of an earlier download).

`RecordSource.where(index)` names a record's file and line (json lines) or row, so a record that does not fit its
dataset type is reported where the user can find it; a file `datasets` cannot parse is scanned to name the bad
line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshkit.core.errors import one_line
from meshkit.data.dataset_entry import DatasetEntry
from meshkit.data.jsonl import DataFormatError, read_jsonl

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow", ".txt": "text"}


@dataclass
class RecordSource:
    """One entry's records (`dataset`, a `datasets.Dataset`), the files they were read from, in order."""

    label: str
    dataset: Any
    files: tuple[str, ...] = ()
    _counts: list[int] | None = field(default=None, repr=False)

    def where(self, index: int) -> str:
        """'file:line' for a json-lines record, 'file: row n' for other files, 'label: row n' otherwise."""
        if not self.files:
            return f"{self.label}: row {index + 1}"
        if self._counts is None:
            self._counts = [_row_count(name) for name in self.files]
        for name, count in zip(self.files, self._counts, strict=True):
            if index < count:
                return _place(name, index)
            index -= count
        return f"{self.label}: row {index + 1}"


def load_source(entry: DatasetEntry, keep_in_memory: bool = False, seed: int = 0) -> RecordSource:
    """The records of `entry`'s split — `datasets`' slicing included (`train[:20%]`, `train[10:100]`,
    `train[:10%]+train[-5%:]`), then the entry's shard (`shards`, `shards_idx`: shuffled with the run's `seed` and
    cut into that many shards, as Axolotl does); every failure is one line naming the dataset and what to do."""
    name, sliced = split_name(entry.split)
    whole = entry.model_copy(update={"split": name}) if sliced else entry
    source = _load_split(whole, keep_in_memory)
    source = _sliced(source, entry.split) if sliced else source
    if entry.shards is None:
        return source
    index = entry.shards_idx or 0
    records = source.dataset.shuffle(seed=seed).shard(num_shards=entry.shards, index=index)
    return RecordSource(f"{source.label} [shard {index} of {entry.shards}]", records)  # (rows numbered within it)


def split_name(split: str) -> tuple[str, bool]:
    """(the split's name, whether a slice follows it): `train[:20%]` -> ("train", True)."""
    name = split.split("[", 1)[0].split("+", 1)[0].strip()
    return name, name != split.strip()


def _sliced(source: RecordSource, split: str) -> RecordSource:
    """`datasets`' own reading of the slice syntax, applied to the split's records."""
    from datasets import ReadInstruction, concatenate_datasets

    name = split_name(split)[0]
    try:
        parts = ReadInstruction.from_spec(split).to_absolute({name: len(source.dataset)})
    except (ValueError, AssertionError) as err:
        raise DataFormatError(
            f"dataset '{source.label}': split '{split}' is not datasets' slice syntax ({err}): e.g. train[:20%]"
        ) from None
    if any(part.splitname != name for part in parts):
        raise DataFormatError(f"dataset '{source.label}': split '{split}' combines several splits: read one")
    pieces = [source.dataset.select(range(part.from_, part.to)) for part in parts]
    records = pieces[0] if len(pieces) == 1 else concatenate_datasets(pieces)
    return RecordSource(f"{source.label} [{split}]", records)  # (rows numbered within the slice)


def _load_split(entry: DatasetEntry, keep_in_memory: bool) -> RecordSource:
    local = Path(entry.path).expanduser()
    if local.exists():
        return _local(entry, local, keep_in_memory)
    if _looks_local(entry.path):
        raise DataFormatError(f"dataset '{entry.path}' does not exist: fix datasets[].path")
    snapshot = _hub_snapshot(entry)
    if snapshot is not None:
        return _local(entry, snapshot, keep_in_memory, label=entry.path)
    return _from_datasets_cache(entry, keep_in_memory)


def _local(entry: DatasetEntry, local: Path, keep_in_memory: bool, label: str | None = None) -> RecordSource:
    label = label or str(local)
    if local.is_dir() and ((local / "state.json").is_file() or (local / "dataset_dict.json").is_file()):
        return _saved(entry, local, label)
    if local.is_file():
        builder = entry.ds_type or BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise DataFormatError(
                f"dataset '{local}': meshkit cannot tell the format of a '{local.suffix}' file: set ds_type "
                f"({', '.join(sorted(set(BUILDERS.values())))})"
            )
        return _build(entry, label, keep_in_memory, builder, data_files={"train": [str(local)]})
    files = _data_files(entry, local)
    return _build(entry, label, keep_in_memory, entry.ds_type or str(local), data_files=files)


def _data_files(entry: DatasetEntry, directory: Path) -> Any:
    if entry.data_files is None:
        return None
    names = [entry.data_files] if isinstance(entry.data_files, str) else list(entry.data_files)
    return {entry.split: [str(directory / name) for name in names]}


def _build(entry: DatasetEntry, label: str, keep_in_memory: bool, builder: str, **options: Any) -> RecordSource:
    from datasets import load_dataset_builder

    try:
        with _quiet_datasets():  # a file it cannot parse is reported below, in one line
            made = load_dataset_builder(builder, name=entry.name, revision=entry.revision, **options)
            made.download_and_prepare()
    except Exception as err:
        raise _unreadable(label, _files_of(options.get("data_files")), err) from None
    splits = made.config.data_files or {}
    if splits and entry.split not in splits:
        raise DataFormatError(
            f"dataset '{label}' has no split '{entry.split}' (it has {', '.join(map(str, splits))}): fix split"
        )
    files = tuple(str(name) for name in splits.get(entry.split, ()))
    return RecordSource(label, made.as_dataset(split=entry.split, in_memory=keep_in_memory), files)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _saved(entry: DatasetEntry, local: Path, label: str) -> RecordSource:
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(local))
    if isinstance(dataset, DatasetDict):
        if entry.split not in dataset:
            raise DataFormatError(
                f"dataset '{label}' has no split '{entry.split}' (it has {', '.join(dataset)}): fix split"
            )
        dataset = dataset[entry.split]
    return RecordSource(label, dataset)


def check_reachable(entry: DatasetEntry) -> None:
    """What loading `entry` would first find wrong, found without loading it (the launcher's check before any
    worker): a local path that does not exist, or a hub name this machine neither has cached nor can reach."""
    local = Path(entry.path).expanduser()
    if local.exists():
        return
    if _looks_local(entry.path):
        raise DataFormatError(f"dataset '{entry.path}' does not exist: fix datasets[].path")
    if _hub_snapshot(entry) is not None or _in_datasets_cache(entry.path) or hub_reachable():
        return
    from datasets import config as datasets_config
    from huggingface_hub import constants

    raise DataFormatError(
        f"dataset '{entry.path}' is not a local path, and the hub has it neither in this machine's caches "
        f"(HF_HUB_CACHE={constants.HF_HUB_CACHE}, HF_DATASETS_CACHE={datasets_config.HF_DATASETS_CACHE}) nor "
        f"within reach (the hub, {_endpoint()}, is out of reach): download it where the hub is reachable "
        f"(huggingface-cli download --repo-type dataset {entry.path}) or point path at local files"
    )


def _hub_snapshot(entry: DatasetEntry) -> Path | None:
    """The local copy `huggingface-cli download --repo-type dataset` left in the hub cache, if any."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(entry.path, repo_type="dataset", revision=entry.revision, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError):
        return None


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Can this machine open a connection to the hub's endpoint? (An offline machine fails the name lookup at
    once, where the hub client would retry for half a minute.)"""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _in_datasets_cache(path: str) -> bool:
    from datasets import config as datasets_config

    return (Path(datasets_config.HF_DATASETS_CACHE) / path.replace("/", "___")).is_dir()


def _from_datasets_cache(entry: DatasetEntry, keep_in_memory: bool) -> RecordSource:
    from datasets import config as datasets_config
    from datasets import load_dataset

    try:
        if not _in_datasets_cache(entry.path) and not hub_reachable():
            raise ConnectionError(f"the hub ({_endpoint()}) is out of reach from this machine")
        dataset = load_dataset(
            entry.path,
            name=entry.name,
            data_files=entry.data_files,
            revision=entry.revision,
            split=entry.split,
            keep_in_memory=keep_in_memory,
        )
    except Exception as err:
        from huggingface_hub import constants

        raise DataFormatError(
            f"dataset '{entry.path}' is not a local path, and the hub has it neither in this machine's caches "
            f"(HF_HUB_CACHE={constants.HF_HUB_CACHE}, HF_DATASETS_CACHE={datasets_config.HF_DATASETS_CACHE}) nor "
            f"within reach ({one_line(str(err), 160)}): download it where the hub is reachable "
            f"(huggingface-cli download --repo-type dataset {entry.path}) or point path at local files"
        ) from None
    return RecordSource(entry.path, dataset)


def _unreadable(label: str, files: list[str], err: Exception) -> DataFormatError:
    """The first bad line of a json-lines file that `datasets` could not parse, else `datasets`' own reason."""
    for name in files:
        if _is_json_lines(name):
            for _ in read_jsonl(name):  # raises DataFormatError naming the file and line
                pass
    cause = err.__cause__ or err.__context__ or err
    return DataFormatError(f"dataset '{label}' cannot be read: {one_line(str(cause) or type(cause).__name__, 300)}")


def _files_of(data_files: Any) -> list[str]:
    if data_files is None:
        return []
    return [str(name) for names in data_files.values() for name in names]


def _looks_local(path: str) -> bool:
    """A path a hub name cannot be: absolute, relative with ./ or ~, more than one slash, or a file suffix."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or Path(path).suffix.lower() in BUILDERS


def _row_count(name: str) -> int:
    if _is_json_lines(name):
        return sum(1 for _ in read_jsonl(name))
    suffix = Path(name).suffix.lower()
    if suffix == ".json":
        with open(name, encoding="utf-8") as handle:
            return len(json.load(handle))
    from datasets import Dataset

    builder = BUILDERS.get(suffix, "arrow")
    if builder == "arrow":
        return len(Dataset.from_file(name))
    from datasets import load_dataset

    return len(load_dataset(builder, data_files=name, split="train"))


def _place(name: str, index: int) -> str:
    if _is_json_lines(name):
        for count, (number, _) in enumerate(read_jsonl(name)):
            if count == index:
                return f"{name}:{number}"
    return f"{name}: row {index + 1}"


def _is_json_lines(name: str) -> bool:
    """A .jsonl file, or a .json file holding one object per line rather than one array."""
    suffix = Path(name).suffix.lower()
    if suffix != ".json":
        return suffix == ".jsonl"
    with open(name, encoding="utf-8") as handle:
        return handle.read(1) != "["


def cpu_share(local_world: int) -> int:
    """Processes a node's rank may use for tokenizing: the CPUs it may run on, shared with its node's ranks."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not every platform has affinity
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_world))


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT
