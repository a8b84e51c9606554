"""`engine.save_model` from sharded layouts, and `meshkit export` of a saved checkpoint, in one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from meshkit import Engine
from meshkit.models.gpt import lm_loss
from tests.core.test_export import load_index
from tests.helpers.checkpointing import GLOBAL_BATCH, adamw
from tests.helpers.cli import meshkit
from tests.helpers.distributed import gloo_world, run_world
from tests.helpers.layouts import build
from tests.helpers.training import split, token_batches

LAYOUTS = {
    "zero3": (2, "gpt", {"zero_stage": 3}),
    "tp2_fused_qkv": (2, "gpt2", {"tp": 2, "dp_replicate": 1}),
    "pp2": (2, "gpt", {"pp": 2, "dp_replicate": 1, "pipeline": {"microbatches": 2}}),
}


def save_all(rank: int, out: str) -> dict[str, dict[str, torch.Tensor]]:
    """`save_both` for every layout, in one world."""
    with gloo_world():
        return {name: save_both(kind, layout, f"{out}/{name}") for name, (_, kind, layout) in LAYOUTS.items()}


def save_both(kind: str, layout: dict, out: str) -> dict[str, torch.Tensor]:
    """Train two steps, then `save_model` and `save_state`; returns the full weights."""
    engine = Engine(seed=0, **layout)
    model = build(kind)
    model, _ = engine.prepare(model, adamw(model), loss_fn=lm_loss)
    local = GLOBAL_BATCH // engine.dp_size
    for batch in token_batches(2, GLOBAL_BATCH):
        engine.train_step(split(batch[engine.dp_rank * local : (engine.dp_rank + 1) * local]))
    engine.save_model(f"{out}/model", max_shard_size="30KB")
    engine.save_state(f"{out}/state")
    full = engine.full_state_dict()
    engine.end()
    return full


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("export")
    return root, run_world(save_all, 2, str(root), timeout=300)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_save_model_and_offline_export_give_the_full_weights(saved, tmp_path, name: str) -> None:
    _, kind, _ = LAYOUTS[name]
    root, everything = saved
    full = everything[name]
    source = root / name
    exported = load_index(source / "model")
    assert len(list((source / "model").glob("model-*-of-*.safetensors"))) > 1
    assert exported.keys() == full.keys()
    for key, tensor in full.items():
        torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0, msg=key)
    model = build(kind)
    model.load_state_dict(exported)  # the user's own module takes the export as it is
    tokens = torch.randint(0, 64, (2, 8))
    reference = build(kind)
    reference.load_state_dict(full)
    torch.testing.assert_close(model(tokens), reference(tokens))

    proc = meshkit("export", str(source / "state"), str(tmp_path / "offline"), "--max-shard-size", "30KB")
    assert proc.returncode == 0, proc.stderr
    offline = load_index(tmp_path / "offline")
    assert offline.keys() == full.keys()
    for key, tensor in full.items():
        torch.testing.assert_close(offline[key], tensor, rtol=0, atol=0, msg=key)


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path) -> None:
    proc = meshkit("export", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert proc.returncode == 2 and "no such checkpoint directory" in proc.stderr and "Traceback" not in proc.stderr


def test_exported_weights_and_checkpoints_follow_the_umask(saved, tmp_path) -> None:
    """Weights are for other people and services too: 0644 under umask 022, as every other file meshkit writes
    (safetensors writes 0600 on its own)."""
    root, _ = saved
    umask = os.umask(0o022)
    os.umask(umask)
    expected = 0o666 & ~umask
    files = [path for path in root.rglob("*") if path.is_file()]
    assert any(path.suffix == ".safetensors" for path in files)
    wrong = {str(path.relative_to(root)): oct(path.stat().st_mode & 0o777) for path in files
             if path.stat().st_mode & 0o777 != expected}  # fmt: skip
    assert not wrong, f"not {oct(expected)}: {wrong}"


def test_an_atomic_write_takes_the_umasks_mode(tmp_path) -> None:
    from meshkit.core.io import write_atomically

    umask = os.umask(0o022)
    try:
        write_atomically(tmp_path / "w.safetensors", tensors={"w": torch.zeros(2)})
        write_atomically(tmp_path / "w.json", text="{}")
    finally:
        os.umask(umask)
    assert {oct(path.stat().st_mode & 0o777) for path in tmp_path.iterdir()} == {"0o644"}
