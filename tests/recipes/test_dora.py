"""DoRA (`peft_use_dora`): the magnitude starts at the base weight's row norms (so the first loss is the base
model's, as with LoRA), ZeRO-3 at world 2 equals one process, the merged export gives the adapter-on-base logits,
and tensor parallel is one line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from tests.helpers.cli import meshkit  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402


def _run(tmp_path, material, world: int, name: str, **keys) -> dict:
    config = write_config(tmp_path / f"{name}.yaml", material, **keys)
    return run_world(run_finetune, world, str(config), [f"output_dir={tmp_path / name}"], timeout=240)[0]


@pytest.mark.slow
def test_dora_starts_as_the_base_trains_the_same_sharded_and_merges(tmp_path, material) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = _run(tmp_path, material, 1, "lora", micro_batch_size=4, **lora_keys())
    one = _run(tmp_path, material, 1, "one", micro_batch_size=4, **lora_keys(peft_use_dora=True))
    two = _run(tmp_path, material, 2, "two", zero_stage=3, **lora_keys(peft_use_dora=True))
    torch.testing.assert_close(torch.tensor(one["losses"][0]), torch.tensor(lora["losses"][0]), rtol=1e-5, atol=0)
    assert one["losses"][1:] != lora["losses"][1:]  # DoRA trains differently from LoRA
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    assert one["trainable_parameters"] > lora["trainable_parameters"]  # the magnitudes train too

    ids = torch.tensor([[1, 20, 31, 42, 53, 64, 75]])
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(material["base"]), two["outputs"]["adapter"]
    )
    merged = AutoModelForCausalLM.from_pretrained(two["outputs"]["merged"])
    with torch.no_grad():
        expected, got = adapted(ids).logits, merged(ids).logits
    assert not torch.allclose(expected, AutoModelForCausalLM.from_pretrained(material["base"])(ids).logits)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_dora_under_tensor_parallel_is_one_line(tmp_path, material) -> None:
    path = write_config(tmp_path / "ft.yaml", material, **lora_keys(peft_use_dora=True))
    proc = meshkit("finetune", str(path), "tp=2", "nproc_per_node=2", timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "DoRA rescales whole output rows" in line]
    assert len(lines) == 1 and "set tp=1 or peft_use_dora: false" in lines[0], proc.stderr[-2000:]


def test_a_saved_dora_magnitude_finds_its_parameter() -> None:
    from meshkit.models.adapters import adapter_parameter_name

    saved = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    assert adapter_parameter_name(saved) == "model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight"
    assert adapter_parameter_name("base_model.model.a.lora_B.weight") == "a.lora_B.default.weight"
