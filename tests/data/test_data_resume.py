"""Exact data resume: the samples read across a save/load equal those of an uninterrupted run."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from meshkit import Engine
from tests.helpers.distributed import run_world

SAMPLES, BATCH, EPOCHS, STOP_AFTER = 20, 2, 3, 7  # 5 steps per epoch at world 2: stop mid second epoch


class SampleIds(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def read_ids(rank: int, options: dict) -> list[tuple[int, list[int]]]:
    """(epoch, this rank's sample ids) per batch, until EPOCHS epochs are read or STOP_AFTER batches."""
    dist.init_process_group("gloo")
    engine = Engine(seed=0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SampleIds(), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    if options.get("load_from"):
        engine.load_state(options["load_from"])
    seen: list[tuple[int, list[int]]] = []
    while loader.epoch < EPOCHS:
        epoch = loader.epoch
        for batch in loader:
            seen.append((epoch, batch.tolist()))
            if options.get("save_to") and len(seen) == STOP_AFTER:
                engine.save_state(options["save_to"])
                engine.end()
                return seen
    engine.end()
    return seen


def _per_epoch(runs: list[list[tuple[int, list[int]]]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for run in runs:
        for epoch, ids in run:
            out.setdefault(epoch, []).extend(ids)
    return out


def test_a_resume_reads_exactly_the_samples_an_uninterrupted_run_reads(tmp_path) -> None:
    whole = run_world(read_ids, 2, {}, timeout=120)
    directory = str(tmp_path / "ckpt")
    first = run_world(read_ids, 2, {"save_to": directory}, timeout=120)
    rest = run_world(read_ids, 2, {"load_from": directory}, timeout=120)
    for rank in range(2):  # same world: each rank's sequence continues exactly
        assert first[rank] + rest[rank] == whole[rank]

    # Another world size: every epoch still covers each sample exactly once.
    alone = run_world(read_ids, 1, {"load_from": directory}, timeout=120)
    epochs = _per_epoch([*first, *alone])
    assert sorted(epochs) == list(range(EPOCHS))
    for epoch, ids in epochs.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: repeated or skipped samples"
    reference = _per_epoch(whole)
    assert [set(ids) for ids in _per_epoch(alone).values()][-1] == set(reference[EPOCHS - 1])
    assert len(whole[0]) == EPOCHS * SAMPLES // (2 * BATCH)


def read_stream(rank: int, options: dict) -> list[list[int]]:
    """A user's own `datasets` stream, split by rank: its ids per batch, until STOP_AFTER batches or its end."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    dist.init_process_group("gloo")
    engine = Engine(seed=0)
    model = torch.nn.Linear(1, 1)
    stream = load_dataset("json", data_files={"train": [options["data"]]}, split="train", streaming=True)
    stream = split_dataset_by_node(stream, rank=engine.dp_rank, world_size=engine.dp_size)
    stream.sharded_by_rank = True
    loader = DataLoader(stream.with_format("torch"), batch_size=BATCH)
    model, loader = engine.prepare(model, loader)
    seen: list[list[int]] = []
    if options.get("load_from"):
        engine.load_state(options["load_from"])
        # (read on from the stream's place, or read again skipping what was read)
        seen.append([-loader._resumed_batches, loader._skip_batches])
    for batch in loader:
        seen.append(batch["id"].tolist())
        if options.get("save_to") and len(seen) == STOP_AFTER:
            engine.save_state(options["save_to"])
            break
    engine.end()
    return seen


def test_a_stateful_stream_resumes_from_its_own_place(tmp_path) -> None:
    """An iterable dataset that keeps its place (`datasets`' `state_dict`) is restored there on each rank, not
    read again from its start (the loader's batch count follows on)."""
    import json

    pytest = __import__("pytest")
    pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(60)))
    whole = run_world(read_stream, 2, {"data": str(data)}, timeout=120)
    directory = tmp_path / "ckpt"
    first = run_world(read_stream, 2, {"data": str(data), "save_to": str(directory)}, timeout=120)
    rest = run_world(read_stream, 2, {"data": str(data), "load_from": str(directory)}, timeout=120)
    for rank in range(2):
        assert rest[rank][0] == [-STOP_AFTER, 0]
        assert first[rank] + rest[rank][1:] == whole[rank]
        saved = json.loads((directory / f"rank-0000{rank}.json").read_text())["loaders"][0]
        assert saved["batches_seen"] == STOP_AFTER and "stream" in saved  # (this rank's own place)
    # Another layout: the places are other ranks' shares, so the stream is read again, the batches read skipped
    alone = run_world(read_stream, 1, {"data": str(data), "load_from": str(directory)}, timeout=120)[0]
    assert alone[0] == [0, STOP_AFTER]
