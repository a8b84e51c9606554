"""Streamed data (`streaming: true`, `pretraining_dataset`): each rank reads its own records, rows are packed as
they come, and a run resumed mid-stream ends with the same weights as one that was not interrupted."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")

from safetensors.torch import load_file  # noqa: E402

from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.streaming import StreamedRows  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import WORDS, run_finetune, write_config  # noqa: E402

TIMEOUT = 240


def _texts(path, count: int):
    lines = [
        json.dumps({"text": f"record {i}: the {WORDS[i % len(WORDS)]} is {WORDS[(i * 7) % len(WORDS)]}"})
        for i in range(count)
    ]  # noqa: E501
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(tokenizer, path, rank: int, size: int, shuffle: bool = False, buffer: int = 8) -> StreamedRows:
    entry = DatasetEntry(path=str(path), type="pretrain", text_column="text")
    return StreamedRows([entry], tokenizer, sequence_len=64, buffer_size=buffer, dp_rank=rank, dp_size=size, seed=0,
                        shuffle=shuffle, pretraining=True)  # fmt: skip


def test_ranks_read_disjoint_records_that_cover_the_stream(tmp_path, tokenizer) -> None:
    path = _texts(tmp_path / "t.jsonl", 30)
    for shuffle in (False, True):
        seen = [[record["text"] for _, record in _rows(tokenizer, path, r, 2, shuffle).records()] for r in range(2)]
        assert not set(seen[0]) & set(seen[1])  # disjoint
        assert sorted(seen[0] + seen[1]) == sorted(json.loads(line)["text"] for line in path.read_text().splitlines())
    rows = list(_rows(tokenizer, path, 0, 1))
    assert rows and all(row["input_ids"].shape == (64,) for row in rows)  # packed rows of sequence_len
    assert all(int((row["position_ids"] == 0).sum()) >= 2 for row in rows[:-1])  # several texts per row


def _long_texts(path, count: int):
    """Texts longer than a row, so that a record's pieces fall into two pack buffers."""
    lines = [json.dumps({"text": f"record {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(30 + i % 40))})
             for i in range(count)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("kind", ["pretraining", "supervised"])
def test_a_stream_restored_from_its_own_place_reads_on_without_reading_the_records_before(
    tmp_path, tokenizer, kind, monkeypatch
) -> None:
    """Stopped after any row (inside a pack buffer, at its end, within a record cut into pieces), a stream restored
    from its `state_dict` yields exactly the rows the uninterrupted one yields next — and reads at most the
    records of the one buffer it refills, never the stream from its start."""
    if kind == "pretraining":
        path, entry = (
            _long_texts(tmp_path / "t.jsonl", 40),
            DatasetEntry(path=str(tmp_path / "t.jsonl"), type="pretrain"),
        )
    else:
        path = tmp_path / "c.jsonl"
        path.write_text(
            "".join(json.dumps({"text": "x " * (i % 7 + 1) * (40 if i % 9 == 0 else 1)}) + "\n" for i in range(60))
        )  # fmt: skip  (every 9th record too long for a row: dropped)
        entry = DatasetEntry(path=str(path), type="completion")

    def rows(rank: int = 0) -> StreamedRows:
        return StreamedRows([entry, entry], tokenizer, sequence_len=32, buffer_size=5, dp_rank=rank, dp_size=2,
                            seed=0, shuffle=False, pretraining=kind == "pretraining")  # fmt: skip

    whole = list(rows())
    assert len(whole) > 12
    read: list = []  # the records a resumed stream reads
    original = StreamedRows.records

    def counting(self, start=None):
        for entry_and_record in original(self, start):
            read.append(entry_and_record)
            yield entry_and_record

    for stop in (1, 4, 7, len(whole) // 2, len(whole) - 1):
        reader = rows()
        first = iter(reader)
        head = [next(first) for _ in range(stop)]
        state = json.loads(json.dumps(reader.state_dict()))  # (it travels in a checkpoint's JSON)
        resumed = rows()
        assert resumed.load_state_dict(state)
        read.clear()
        with monkeypatch.context() as patch:
            patch.setattr(StreamedRows, "records", counting)
            tail = list(resumed)
        assert len(head) + len(tail) == len(whole)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(head + tail, whole, strict=True) for k in a)
        assert resumed.too_long == rows_too_long(rows())
        records_after = sum(1 for _ in original(rows()))  # this rank's records
        assert len(read) <= records_after  # (never the whole stream again when resumed past its first buffer)
        if stop >= len(whole) // 2:
            assert len(read) < records_after * 0.75
    assert not rows(1).load_state_dict(state)  # another rank's share: refused, the loader then replays


def rows_too_long(rows: StreamedRows) -> int:
    list(rows)
    return rows.too_long


def test_a_shuffled_stream_mixes_each_buffer_by_epoch_and_resumes_exactly(tmp_path, tokenizer) -> None:
    path = _texts(tmp_path / "t.jsonl", 40)

    plain, shuffled = list(_rows(tokenizer, path, 0, 1)), _rows(tokenizer, path, 0, 1, shuffle=True)
    first = list(shuffled)
    shuffled.set_epoch(1)
    second = list(shuffled)
    assert [r["input_ids"].tolist() for r in first] != [r["input_ids"].tolist() for r in plain]
    assert [r["input_ids"].tolist() for r in first] != [r["input_ids"].tolist() for r in second]  # per epoch
    assert sum(int(r["labels"].ne(-100).sum()) for r in first) == sum(int(r["labels"].ne(-100).sum()) for r in plain)
    reader = _rows(tokenizer, path, 0, 1, shuffle=True)
    reader.set_epoch(1)
    stream = iter(reader)
    head = [next(stream) for _ in range(3)]
    resumed = _rows(tokenizer, path, 0, 1, shuffle=True)
    resumed.set_epoch(1)
    assert resumed.load_state_dict(reader.state_dict())
    assert [r["input_ids"].tolist() for r in head + list(resumed)] == [r["input_ids"].tolist() for r in second]


def test_a_run_resumed_mid_stream_ends_with_the_same_weights(tmp_path, material) -> None:
    data = _texts(tmp_path / "pretrain.jsonl", 120)
    keys = {
        "datasets": None, "pretraining_dataset": [{"path": str(data), "text_column": "text"}],
        "streaming_multipack_buffer_size": 16, "sequence_len": 64, "max_steps": 6, "save_steps": 3,
        "save_total_limit": 5,
    }  # fmt: skip
    whole_config = write_config(tmp_path / "whole.yaml", material, **keys)
    whole = run_world(run_finetune, 2, str(whole_config), [f"output_dir={tmp_path / 'whole'}"], timeout=TIMEOUT)[0]
    saved = tmp_path / "whole" / "checkpoints" / "step-000003"
    places = [json.loads((saved / f"rank-0000{r}.json").read_text())["loaders"][0]["stream"] for r in range(2)]
    assert [place["dp"] for place in places] == [[0, 2], [1, 2]]  # each rank's own place in its share
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-000003", resumed_dir / "checkpoints" / "step-000003")
    resumed_config = write_config(tmp_path / "resumed.yaml", material, **keys, auto_resume_from_checkpoints=True)
    resumed = run_world(run_finetune, 2, str(resumed_config), [f"output_dir={resumed_dir}"], timeout=TIMEOUT)[0]
    assert resumed["resumed_at_step"] == 3 and resumed["losses"] == whole["losses"]
    a, b = (
        load_file(tmp_path / "whole" / "merged/model.safetensors"),
        load_file(resumed_dir / "merged/model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole["losses"][-1] < whole["losses"][0]


def test_streaming_needs_max_steps(tmp_path, material) -> None:
    from meshkit.config.resolve import ConfigError
    from meshkit.recipes.finetune_config import resolve_finetune
    from tests.helpers.cli import meshkit

    data = _texts(tmp_path / "t.jsonl", 4)
    path = write_config(tmp_path / "s.yaml", material, max_steps=None, streaming=True,
                        datasets=[{"path": str(data), "type": "completion"}])  # fmt: skip
    proc = meshkit("finetune", str(path))
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "needs max_steps" in errors[0], proc.stderr
    with pytest.raises(ConfigError, match="a stream holds no validation split"):
        resolve_finetune(write_config(tmp_path / "v.yaml", material, streaming=True, val_set_size=2), [], env={})


STREAM_PEAK = """
import json, resource, sys
from transformers import AutoTokenizer
from meshkit.data.dataset_entry import DatasetEntry
from meshkit.data.streaming import StreamedRows
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
entry = DatasetEntry(path=sys.argv[2], type="pretrain")
rows = StreamedRows([entry], tokenizer, sequence_len=64, buffer_size=64, dp_rank=0, dp_size=1, seed=0, shuffle=False,
                    pretraining=True)
peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss for _ in rows]  # the peak after each row
print(json.dumps({"rows": len(peaks), "peaks_kb": [peaks[len(peaks) // 4], peaks[len(peaks) // 2], peaks[-1]]}))
"""


@pytest.mark.slow
def test_peak_memory_stays_flat_in_the_streams_length(tmp_path, material) -> None:
    """No tokenized copy of the stream is kept: past the reader's first block (datasets reads json in 10 MB
    blocks), reading twice the rows leaves the peak where it was; a kept copy would grow with every row."""
    import subprocess
    import sys

    words = " ".join(WORDS * 8)  # ~500 characters a record: few tokenizer calls, 24k records ~13 MB of json
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i}: {words}"}) + "\n" for i in range(24_000)))
    proc = subprocess.run([sys.executable, "-c", STREAM_PEAK, str(material["base"]), str(path), "0"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    quarter, half, whole = measured["peaks_kb"]
    assert whole - half < 8 * 1024, measured  # (a kept copy of the tokens: ~1 KB per 64-token row, tens of MB)
