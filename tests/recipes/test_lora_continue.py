"""`lora_model_dir`: a LoRA run continues the adapter another run wrote — its settings from adapter_config.json,
its weights into every rank's shards (here ZeRO-3 at world 2) — and a directory that is not an adapter is one
line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from meshkit.tuning.lora import LoraSetupError, continued_config  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402


def _run(tmp_path, material, world: int, name: str, **keys) -> dict:
    config = write_config(tmp_path / f"{name}.yaml", material, val_set_size=4, **keys)
    return run_world(run_finetune, world, str(config), [f"output_dir={tmp_path / name}"], timeout=240)[0]


@pytest.mark.slow
def test_a_continued_adapter_starts_where_the_first_run_ended(tmp_path, material) -> None:
    first = _run(tmp_path, material, 1, "first", micro_batch_size=4, **lora_keys())
    # the continuing config asks for another rank: the adapter's own settings apply, as when peft loads it
    keys = lora_keys(lora_r=2, lora_model_dir=first["outputs"]["adapter"])
    second = _run(tmp_path, material, 2, "second", zero_stage=3, learning_rate=1e-12, max_steps=1, **keys)
    assert second["trainable_parameters"] == first["trainable_parameters"]
    ended, started = first["evals"][-1]["eval_loss"], second["evals"][-1]["eval_loss"]
    torch.testing.assert_close(torch.tensor(started), torch.tensor(ended), rtol=1e-5, atol=0)
    fresh = _run(tmp_path, material, 1, "fresh", learning_rate=1e-12, max_steps=1, **lora_keys())
    assert abs(fresh["evals"][-1]["eval_loss"] - ended) > 1e-3  # a new adapter does not start there


def test_a_directory_without_an_adapter_is_one_line(tmp_path) -> None:
    with pytest.raises(LoraSetupError, match="holds no adapter_config.json and adapter_model.safetensors"):
        continued_config(tmp_path, "base")
