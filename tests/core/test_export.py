"""safetensors export (shards + index), the state-dict digest, and atomic writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from meshkit import Engine
from meshkit.core.io import INDEX_NAME, parse_size, save_safetensors, state_dict_sha256
from tests.helpers.training import tiny_gpt


def load_index(out_dir) -> dict[str, torch.Tensor]:
    index = json.loads((out_dir / INDEX_NAME).read_text())
    state: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(index["weight_map"].values())):
        state.update(load_file(out_dir / file_name))
    assert set(state) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    return state


def test_save_model_reproduces_the_outputs(tmp_path) -> None:
    with Engine() as engine:
        model = engine.prepare(tiny_gpt(seed=4))
        index = engine.save_model(tmp_path / "export", max_shard_size="20KB")
        assert index.name == INDEX_NAME
        shards = sorted(p.name for p in (tmp_path / "export").glob("*.safetensors"))
        assert len(shards) > 1 and shards[0].startswith("model-00001-of-")
        restored = tiny_gpt(seed=99)
        restored.load_state_dict(load_index(tmp_path / "export"))
        tokens = torch.randint(0, 64, (2, 8))
        torch.testing.assert_close(restored(tokens), model(tokens))
        assert not list((tmp_path / "export").glob("*.tmp"))


def test_reexport_with_fewer_shards_removes_stale_files(tmp_path) -> None:
    state = tiny_gpt().state_dict()
    save_safetensors(state, tmp_path, max_shard_size="20KB")
    save_safetensors(state, tmp_path, max_shard_size="1GB")
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert load_index(tmp_path).keys() == state.keys()


def test_tied_weights_are_written_once(tmp_path) -> None:
    model = tiny_gpt()
    model.output.weight = model.tok_embeddings.weight
    save_safetensors(model.state_dict(), tmp_path)
    assert "output.weight" not in load_index(tmp_path)


def test_sha256_depends_on_values_only_not_on_key_order() -> None:
    state = tiny_gpt().state_dict()
    reordered = dict(reversed(list(state.items())))
    assert state_dict_sha256(state) == state_dict_sha256(reordered)
    changed = {k: v.clone() for k, v in state.items()}
    changed["norm.weight"][0] += 1e-6
    assert state_dict_sha256(changed) != state_dict_sha256(state)


def test_parse_size() -> None:
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="is not a byte count"):
        parse_size("lots")
