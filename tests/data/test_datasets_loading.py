"""Fine-tune data through Hugging Face `datasets`: every local format gives the same samples, directories and
splits, hub names from this machine's caches (offline), records located by file and line, tokenizing in several
processes, and tokenized tables kept at dataset_prepared_path and reused only while nothing they depend on
changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402

from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.jsonl import DataFormatError  # noqa: E402
from meshkit.data.tokenized import TokenizedRows, load_samples  # noqa: E402
from meshkit.recipes.instruction_data import shuffled  # noqa: E402
from tests.helpers.cli import meshkit  # noqa: E402
from tests.helpers.finetune_runs import alpaca_records, write_config, write_jsonl  # noqa: E402

RECORDS = alpaca_records(12)


def _load(entries, tokenizer, **options):
    entries = [e if isinstance(e, DatasetEntry) else DatasetEntry(**e) for e in entries]
    return load_samples(entries, tokenizer, sequence_len=256, train_on_inputs=False, **options)


def _ids(rows: TokenizedRows) -> list[tuple[int, ...]]:
    return [sample.input_ids for sample in rows]


def _write_arrow(path: Path, records: list[dict]) -> Path:
    table = datasets.Dataset.from_list(records).data.table
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def test_every_local_format_gives_the_same_samples(tmp_path, tokenizer) -> None:
    reference, _ = _load([{"path": write_jsonl(tmp_path / "a.jsonl", RECORDS), "type": "alpaca"}], tokenizer)
    frame = datasets.Dataset.from_list(RECORDS)
    (tmp_path / "a.json").write_text(json.dumps(RECORDS))
    frame.to_parquet(tmp_path / "a.parquet")
    frame.to_csv(tmp_path / "a.csv", index=False)
    (tmp_path / "noext").write_text((tmp_path / "a.jsonl").read_text())
    sources = [
        {"path": tmp_path / "a.json"},
        {"path": tmp_path / "a.parquet"},
        {"path": tmp_path / "a.csv"},
        {"path": _write_arrow(tmp_path / "a.arrow", RECORDS)},
        {"path": tmp_path / "noext", "ds_type": "json"},
    ]
    for source in sources:
        rows, report = _load([{**source, "type": "alpaca"}], tokenizer)
        assert _ids(rows) == _ids(reference), source
        assert report.kept == len(RECORDS)
    with pytest.raises(DataFormatError, match="cannot tell the format of a '' file: set ds_type"):
        _load([{"path": tmp_path / "noext", "type": "alpaca"}], tokenizer)


def test_directories_splits_data_files_and_saved_datasets(tmp_path, tokenizer) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", RECORDS[:8])
    write_jsonl(folder / "test.jsonl", RECORDS[8:])
    train, _ = _load([{"path": folder, "type": "alpaca"}], tokenizer)
    test, _ = _load([{"path": folder, "type": "alpaca", "split": "test"}], tokenizer)
    assert (len(train), len(test)) == (8, 4)
    picked, _ = _load([{"path": folder, "type": "alpaca", "data_files": ["test.jsonl"]}], tokenizer)
    assert _ids(picked) == _ids(test)
    with pytest.raises(DataFormatError, match="has no split 'validation' \\(it has train, test\\)"):
        _load([{"path": folder, "type": "alpaca", "split": "validation"}], tokenizer)
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS[:8]), "test": datasets.Dataset.from_list(RECORDS[8:])}
    ).save_to_disk(saved)
    from_disk, _ = _load([{"path": saved, "type": "alpaca", "split": "test"}], tokenizer)
    assert _ids(from_disk) == _ids(test)


def test_a_hub_name_is_read_from_this_machines_caches_offline(tmp_path, tokenizer, monkeypatch) -> None:
    from huggingface_hub import constants

    reference, _ = _load([{"path": write_jsonl(tmp_path / "r.jsonl", RECORDS), "type": "alpaca"}], tokenizer)
    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    with pytest.raises(DataFormatError, match="'someorg/tiny' is not a local path.*huggingface-cli download"):
        _load([{"path": "someorg/tiny", "type": "alpaca"}], tokenizer)
    # what `huggingface-cli download --repo-type dataset someorg/tiny` leaves behind
    revision = "0" * 40
    repo = hub / "datasets--someorg--tiny"
    (repo / "snapshots" / revision / "data").mkdir(parents=True)
    write_jsonl(repo / "snapshots" / revision / "data" / "train.jsonl", RECORDS)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    rows, _ = _load([{"path": "someorg/tiny", "type": "alpaca"}], tokenizer)
    assert _ids(rows) == _ids(reference)
    # what an earlier online load_dataset left in datasets' own cache
    cache = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    built = datasets.load_dataset_builder(
        "json", data_files={"train": [str(tmp_path / "r.jsonl")]}, cache_dir=str(tmp_path / "build")
    )
    built.download_and_prepare()
    version_dir = Path(built.cache_dir).parent.parent
    (cache / "otherorg___cached").mkdir(parents=True)
    shutil.move(version_dir, cache / "otherorg___cached" / "default")
    for arrow in (cache / "otherorg___cached").rglob("json-*.arrow"):
        arrow.rename(arrow.with_name(arrow.name.replace("json-", "cached-")))
    rows, _ = _load([{"path": "otherorg/cached", "type": "alpaca"}], tokenizer)
    assert _ids(rows) == _ids(reference)


def test_bad_records_are_named_by_file_and_line_or_row(tmp_path, tokenizer) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    write_jsonl(folder / "train-0.jsonl", RECORDS[:3])
    (folder / "train-1.jsonl").write_text(
        json.dumps(RECORDS[3]) + "\n\n" + json.dumps({"instruction": "x", "input": ""}) + "\n"
    )
    with pytest.raises(DataFormatError, match=r"train-1.jsonl:3: the record has no 'output' field"):
        _load([{"path": folder, "type": "alpaca"}], tokenizer)
    datasets.Dataset.from_list([*RECORDS[:2], {"instruction": "x", "input": "", "output": None}]).to_parquet(
        tmp_path / "p.parquet"
    )
    with pytest.raises(DataFormatError, match=r"p.parquet: row 3: the record has no 'output' field"):
        _load([{"path": tmp_path / "p.parquet", "type": "alpaca"}], tokenizer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(RECORDS[0]) + "\n[1, 2]\n")
    with pytest.raises(DataFormatError, match=r"broken.jsonl:2: a record must be a JSON object"):
        _load([{"path": broken, "type": "alpaca"}], tokenizer)


def test_several_processes_tokenize_the_same_and_still_name_the_line(tmp_path, tokenizer) -> None:
    many = alpaca_records(1100, seed=3)
    data = write_jsonl(tmp_path / "many.jsonl", many)
    one, _ = _load([{"path": data, "type": "alpaca"}], tokenizer, num_proc=1)
    two, _ = _load([{"path": data, "type": "alpaca"}], tokenizer, num_proc=2, keep_in_memory=True)
    assert _ids(one) == _ids(two) and len(one) == 1100
    many[1050] = {"instruction": "x"}
    write_jsonl(tmp_path / "bad.jsonl", many)
    with pytest.raises(DataFormatError, match=r"bad.jsonl:1051: the record has no 'output' field"):
        _load([{"path": tmp_path / "bad.jsonl", "type": "alpaca"}], tokenizer, num_proc=2)


def test_prepared_tables_are_reused_only_while_data_tokenizer_and_settings_match(tmp_path, tokenizer) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    prepared = tmp_path / "prepared"
    entry = [{"path": data, "type": "alpaca"}]
    first, report = _load(entry, tokenizer, prepared=prepared)
    assert report.reused == [] and len([p for p in prepared.iterdir()]) == 1
    again, report = _load(entry, tokenizer, prepared=prepared)
    assert report.reused == [str(data)] and _ids(again) == _ids(first)
    _, report = load_samples(
        [DatasetEntry(**entry[0])], tokenizer, sequence_len=256, train_on_inputs=True, prepared=prepared
    )
    assert report.reused == []  # another setting
    changed = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    changed.add_tokens(["<newtoken>"])
    assert _load(entry, changed, prepared=prepared)[1].reused == []  # another tokenizer
    write_jsonl(data, RECORDS[:6])
    rows, report = _load(entry, tokenizer, prepared=prepared)
    assert report.reused == [] and len(rows) == 6  # other records
    assert not [p for p in prepared.iterdir() if p.name.startswith(".")]  # no partial table left behind


def test_merged_datasets_are_shuffled_by_the_seed(tmp_path, tokenizer) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", RECORDS[:6])
    second = write_jsonl(tmp_path / "b.jsonl", RECORDS[6:])
    merged, report = _load([{"path": first, "type": "alpaca"}, {"path": second, "type": "alpaca"}], tokenizer)
    assert report.per_file == {str(first): 6, str(second): 6}
    order = _ids(shuffled(merged, seed=1))
    assert order != _ids(merged) and sorted(order) == sorted(_ids(merged))
    assert order == _ids(shuffled(merged, seed=1)) != _ids(shuffled(merged, seed=2))


@pytest.mark.slow
def test_a_finetune_reads_parquet_and_keeps_its_prepared_data(tmp_path, material) -> None:
    records = [json.loads(line) for line in material["alpaca"].read_text().splitlines()]
    datasets.Dataset.from_list(records).to_parquet(tmp_path / "train.parquet")
    keys = {
        "datasets": [{"path": str(tmp_path / "train.parquet"), "type": "alpaca"}],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "dataset_processes": 2,
        "max_steps": 2,
    }
    config = write_config(tmp_path / "ft.yaml", material, **keys)
    first = meshkit("finetune", str(config), f"output_dir={tmp_path / 'one'}")
    assert first.returncode == 0, first.stderr
    assert "tokenizing" in first.stderr + first.stdout and "reusing" not in first.stdout
    assert len([table for table in (tmp_path / "prepared").iterdir() if (table / "state.json").is_file()]) == 1


def test_split_slices_as_datasets_reads_them(tmp_path, tokenizer) -> None:
    """Axolotl's examples write `split: train[:20%]`: datasets' own slice syntax selects the records."""
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)  # 12 records
    whole, _ = _load([{"path": path, "type": "alpaca"}], tokenizer)
    for split, picked in (("train[:25%]", slice(0, 3)), ("train[4:7]", slice(4, 7)), ("train[-2:]", slice(10, 12))):
        rows, report = _load([{"path": path, "type": "alpaca", "split": split}], tokenizer)
        assert _ids(rows) == _ids(whole)[picked] and report.kept == picked.stop - picked.start, split
    both, _ = _load([{"path": path, "type": "alpaca", "split": "train[:2]+train[-1:]"}], tokenizer)
    assert _ids(both) == _ids(whole)[:2] + _ids(whole)[-1:]
    with pytest.raises(DataFormatError, match=r"split 'train\[:x%\]' is not datasets' slice syntax") as caught:
        _load([{"path": path, "type": "alpaca", "split": "train[:x%]"}], tokenizer)
    assert "\n" not in str(caught.value)
    with pytest.raises(DataFormatError, match="has no split 'test'"):
        _load([{"path": path, "type": "alpaca", "split": "test[:10%]"}], tokenizer)
