"""`meshkit finetune` checks the layout against the base model before any worker starts (built on the meta device
from its config.json): one line naming the model's head counts, blocks or experts, offering only sizes that fit both
the model and the world."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.test_bad_input import _one_line_error, in_process
from tests.helpers.finetune_runs import alpaca_records, write_config, write_jsonl

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def three_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from meshkit.recipes.tiny_model import make_tiny_base_model, texts_of_jsonl

    root = tmp_path_factory.mktemp("preflight")
    alpaca = write_jsonl(root / "alpaca.jsonl", alpaca_records(8))
    base = make_tiny_base_model(
        root / "base", texts_of_jsonl([alpaca]), vocab_size=320, hidden_size=48, layers=2, heads=3, kv_heads=3
    )
    return {"alpaca": alpaca, "base": base}


@pytest.mark.parametrize(
    ("keys", "needles"),
    [
        (  # the case users met: the sizes offered fit the world of 2 (tp 3 would not)
            {"tensor_parallel_size": 2, "meshkit": {"launch": {"nproc_per_node": 2}}},
            ["tp=2 does not divide the attention's head counts (heads=3, kv_heads=3): choose tp 1 (1 node(s)"],
        ),
        (
            {"meshkit": {"launch": {"nproc_per_node": 4}, "parallel": {"pp": 4}}},
            ["pp=4 × 1 stage(s) per rank needs at least 4 blocks, the model has 2: choose pp 1 or 2"],
        ),
    ],
)
def test_a_layout_the_base_model_cannot_take_stops_before_the_workers(
    tmp_path: Path, three_heads: dict[str, Path], keys: dict, needles: list[str]
) -> None:
    config = write_config(tmp_path / "run.yaml", three_heads, **keys)
    line = _one_line_error(in_process("finetune", str(config)), *needles)
    assert "meshkit launch" not in line  # (a worker's failure is reported by the launcher, naming its rank)


def test_a_bad_value_names_the_key_as_written_and_its_file(tmp_path: Path, three_heads: dict[str, Path]) -> None:
    config = write_config(tmp_path / "run.yaml", three_heads, micro_batch_size="two")
    line = _one_line_error(in_process("finetune", str(config)), "invalid value 'two' for 'train.micro_batch_size'")
    assert "run.yaml (micro_batch_size))" in line and ".int" not in line  # (pydantic's union tag)
    env = {"MESHKIT_TRAIN__MICRO_BATCH_SIZE": "x"}
    line = _one_line_error(in_process("config", "show", env=env), "(env MESHKIT_TRAIN__MICRO_BATCH_SIZE)")
    assert "'train.micro_batch_size'" in line


def test_a_base_model_without_tokenizer_files_names_what_was_looked_for(
    tmp_path: Path, three_heads: dict[str, Path]
) -> None:
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(three_heads["base"] / name, bare / name)
    config = write_config(tmp_path / "run.yaml", {**three_heads, "base": bare})
    line = _one_line_error(in_process("finetune", str(config)), f"base_model '{bare}' has no tokenizer files")
    assert "tokenizer.json" in line and "set tokenizer_config" in line


def test_a_hub_dataset_out_of_reach_is_one_line_without_retries(
    tmp_path: Path, three_heads: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # (nothing listens there: refused at once)
    config = write_config(
        tmp_path / "run.yaml", three_heads, datasets=[{"path": "meshkit-tests/absent", "type": "alpaca"}]
    )
    line = _one_line_error(in_process("finetune", str(config)), "dataset 'meshkit-tests/absent' is not a local path")
    assert "the hub (http://127.0.0.1:9) is out of reach" in line and "huggingface-cli download" in line
