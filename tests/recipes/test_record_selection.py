"""Axolotl's record-selection keys, honoured: `dataset_shard_num`/`dataset_shard_idx` (one contiguous shard of the
merged records), `dataset_exact_deduplication` (exact repeats dropped before the validation split, counted) and
`curriculum_sampling` (batches in the records' order)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")

from meshkit.data.selection import first_occurrences, shard, without_repeats  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import alpaca_records, write_config  # noqa: E402


def test_repeats_and_shards_on_a_table() -> None:
    from datasets import Dataset

    table = Dataset.from_dict(
        {"input_ids": [[1, 2], [3], [1, 2], [3], [4]], "labels": [[1, 2], [3], [1, 2], [-100], [4]]}
    )
    assert first_occurrences(table, ["input_ids", "labels"]) == [0, 1, 3, 4]  # [3] with other labels is no repeat
    assert first_occurrences(table, ["input_ids"]) == [0, 1, 4]
    kept, dropped = without_repeats(table, ["input_ids", "labels"])
    assert dropped == 1 and len(kept) == 4
    assert shard(table, 2, 1)["input_ids"] == [[3], [4]] and shard(table, None, None) is table
    assert shard(table, 2, 0)["input_ids"] == [[1, 2], [3], [1, 2]]  # contiguous, the first shard one longer


def prepared(rank: int, config: str, assignments: list[str]) -> dict:
    from meshkit.engine.engine import Engine
    from meshkit.recipes.finetune_config import resolve_finetune
    from meshkit.recipes.hf_base import load_tokenizer
    from meshkit.recipes.instruction_data import prepare_data

    job = resolve_finetune(config, assignments)
    with Engine(job.resolved) as engine:
        data = prepare_data(engine, job.settings, load_tokenizer(job.settings))
        first = next(iter(data.loader))["input_ids"][:, :12].tolist()
        in_order = [list(sample.input_ids[:12]) for sample in data.train[:2]]
        counts = {"train": len(data.train), "validation": len(data.validation), "repeated": data.report.repeated}
        return {**counts, "first_batch": first, "in_order": in_order}


def test_the_keys_choose_and_order_the_training_samples(tmp_path, material) -> None:
    records = alpaca_records(12, seed=3)
    data = tmp_path / "twice.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records + records))  # every record twice
    datasets = [{"path": str(data), "type": "alpaca"}]
    config = str(write_config(tmp_path / "c.yml", material, datasets=datasets, micro_batch_size=2, val_set_size=2))

    def run(*keys: str) -> dict:
        return run_world(prepared, 1, config, list(keys), timeout=120)[0]

    plain = run()
    assert (plain["train"], plain["validation"], plain["repeated"]) == (22, 2, 0)
    unique = len({json.dumps(r, sort_keys=True) for r in records})
    deduplicated = run("dataset_exact_deduplication=true")
    assert deduplicated["repeated"] == 24 - unique
    assert deduplicated["train"] + deduplicated["validation"] == unique
    sharded = run("dataset_shard_num=4", "dataset_shard_idx=3")
    assert sharded["train"] + sharded["validation"] == 6
    ordered = run("curriculum_sampling=true", "val_set_size=0")
    assert [row[: len(ids)] for row, ids in zip(ordered["first_batch"], ordered["in_order"], strict=True)] == ordered[
        "in_order"
    ]
