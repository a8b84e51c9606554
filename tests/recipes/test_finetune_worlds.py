"""The fine-tuning recipe in real gloo worlds: parallel runs equal one process, resume is exact, and the
outputs load with `from_pretrained` / `PeftModel.from_pretrained`."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from safetensors.torch import load_file  # noqa: E402

from meshkit.checkpoint.model_export import export_checkpoint  # noqa: E402
from meshkit.models.adapters import base_checkpoint_name  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, make_gpt2_base, run_finetune, write_config  # noqa: E402

TIMEOUT = 180


def _run(tmp_path, material, world: int, name: str, assignments: list[str], **keys):
    run_dir = tmp_path / name
    run_dir.mkdir()
    config = write_config(run_dir / "ft.yaml", material, **keys)
    # an argument outranks the tests' MESHKIT_LOGGING__DIR (the environment outranks the file's output_dir)
    arguments = [f"output_dir={run_dir / 'out'}", *assignments]
    return run_world(run_finetune, world, str(config), arguments, timeout=TIMEOUT)[0]


@pytest.fixture(scope="module")
def references(tmp_path_factory, material):
    """One process on the global batch (4 samples) of two ranks × 2, full and LoRA."""
    root = tmp_path_factory.mktemp("reference")
    full = _run(root, material, 1, "full", ["micro_batch_size=4"], val_set_size=4, eval_steps=2)
    lora = _run(root, material, 1, "lora", ["micro_batch_size=4"], val_set_size=4, eval_steps=2, **lora_keys())
    return {"full": full, "lora": lora}


def _close(got: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("adapter", ["full", "lora"])
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_two_ranks_equal_one_process(tmp_path, material, references, adapter, zero_stage) -> None:
    keys = lora_keys() if adapter == "lora" else {}
    summary = _run(tmp_path, material, 2, "run", [f"zero_stage={zero_stage}"], val_set_size=4, eval_steps=2, **keys)
    reference = references[adapter]
    _close(summary["losses"], reference["losses"])
    _close([e["eval_loss"] for e in summary["evals"]], [e["eval_loss"] for e in reference["evals"]])
    assert summary["losses"][-1] < summary["losses"][0]  # it learns
    assert summary["trainable_parameters"] == reference["trainable_parameters"]


@pytest.mark.parametrize("layout", [["cp=2"], ["pp=2"]])
def test_packed_rows_under_cp_and_pp_equal_one_process(tmp_path, material, layout) -> None:
    """sample_packing keeps each row's samples apart by position_ids: ring attention (cp) and every pipeline
    stage (pp) read them, as the model's own masks do in one process."""
    keys = {"sample_packing": True, "micro_batch_size": 2}  # rows of 256 tokens: 2 to 3 samples each
    reference = _run(tmp_path, material, 1, "reference", [], **keys)
    summary = _run(tmp_path, material, 2, "run", layout, **keys)  # dp = 1: the same rows on each rank
    _close(summary["losses"], reference["losses"])
    assert summary["losses"][-1] < summary["losses"][0]


@pytest.mark.parametrize("layout", [["tp=2"], ["pp=2"]])
def test_lora_under_model_parallel_equals_one_process(tmp_path, material, references, layout) -> None:
    # dp = 1: each rank sees the whole global batch of 4, as the reference did
    summary = _run(tmp_path, material, 2, "run", [*layout, "micro_batch_size=4"], val_set_size=4, eval_steps=2,
                   **lora_keys())  # fmt: skip
    _close(summary["losses"], references["lora"]["losses"])
    _close([e["eval_loss"] for e in summary["evals"]], [e["eval_loss"] for e in references["lora"]["evals"]])


def test_resume_mid_epoch_gives_the_same_weights(tmp_path, material) -> None:
    # 32 samples, 2 ranks × 2 per batch: 8 steps per epoch; step 3 is mid-epoch, step 10 in the second epoch
    keys = {**lora_keys(), "max_steps": 10, "save_steps": 3, "save_total_limit": 5}
    whole = _run(tmp_path, material, 2, "whole", [], **keys)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "whole" / "out" / "checkpoints" / "step-000003", resumed_dir / "out" / "checkpoints" / "step-000003"
    )
    resumed = _run(
        tmp_path,
        material,
        2,
        "resumed-run",
        [f"output_dir={resumed_dir / 'out'}"],
        **keys,
        auto_resume_from_checkpoints=True,
    )
    assert resumed["resumed_at_step"] == 3
    assert resumed["losses"] == whole["losses"]
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        a, b = load_file(tmp_path / "whole" / "out" / name), load_file(resumed_dir / "out" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_outputs_load_and_agree_and_base_weights_stay_bit_equal(tmp_path, material) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    keys = {
        **lora_keys(lora_target_linear=False, lora_target_modules=["q_proj", "v_proj", "down_proj"]),
        "save_steps": 4,
    }
    summary = _run(tmp_path, material, 2, "lora", ["zero_stage=3"], **keys)
    out = tmp_path / "lora" / "out"
    assert summary["outputs"] == {"adapter": str(out), "merged": str(out / "merged")}
    ids = torch.randint(4, 300, (2, 24))
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(material["base"]), out)
    torch.testing.assert_close(_logits(merged, ids), _logits(adapted, ids), rtol=1e-5, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(material["base"])
    assert (_logits(merged, ids) - _logits(base, ids)).abs().max() > 1e-4  # the adapter changed the model
    AutoTokenizer.from_pretrained(out / "merged")  # tokenizer files travel with the export
    # the checkpoint's base weights are the base model's, bit for bit
    stored = load_file(export_checkpoint(out / "checkpoints", tmp_path / "ckpt").parent / "model.safetensors")
    original = load_file(material["base"] / "model.safetensors")
    bases = {name: t for name, t in stored.items() if "lora_" not in name}
    assert len(bases) == len(original)
    assert all(torch.equal(t, original[base_checkpoint_name(name)]) for name, t in bases.items())


@pytest.mark.parametrize("layout", [["zero_stage=3"], ["pp=2"]])
def test_full_fine_tune_export_equals_the_trained_weights(tmp_path, material, layout) -> None:
    from transformers import AutoModelForCausalLM

    summary = _run(tmp_path, material, 2, "full", layout, save_steps=4)
    out = tmp_path / "full" / "out"
    assert "adapter" not in summary["outputs"]
    trained = load_file(export_checkpoint(out / "checkpoints", tmp_path / "ckpt").parent / "model.safetensors")
    exported = load_file(out / "merged" / "model.safetensors")
    assert trained.keys() == exported.keys() and all(torch.equal(trained[k], exported[k]) for k in trained)
    model = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert torch.equal(model.lm_head.weight.detach(), exported["lm_head.weight"])


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory, material):
    return {**material, "base": make_gpt2_base(tmp_path_factory.mktemp("gpt2"), material)}


def test_gpt2_lora_under_tp_and_pp_equals_one_process_and_exports_load(tmp_path, gpt2) -> None:
    # a tied head, Conv1D layers and a fused q/k/v layer streamed in from a checkpoint
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    keys = lora_keys(lora_target_linear=False, lora_target_modules=["c_fc", "c_proj"])
    reference = _run(tmp_path, gpt2, 1, "one", ["micro_batch_size=4"], **keys)
    split = _run(tmp_path, gpt2, 2, "tp", ["tp=2", "micro_batch_size=4"], **keys)
    _close(split["losses"], reference["losses"])
    staged = _run(
        tmp_path, gpt2, 2, "pp", ["pp=2", "micro_batch_size=4"], **{**keys, "lora_target_modules": ["c_attn"]}
    )
    ids = torch.randint(4, 300, (2, 16))
    for name in ("tp", "pp"):
        out = tmp_path / name / "out"
        merged = AutoModelForCausalLM.from_pretrained(out / "merged")
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gpt2["base"]), out)
        torch.testing.assert_close(_logits(merged, ids), _logits(adapted, ids), rtol=1e-5, atol=1e-5)
        assert merged.lm_head.weight.data_ptr() == merged.transformer.wte.weight.data_ptr()
        assert "lm_head.weight" not in load_file(out / "merged" / "model.safetensors")  # tied: written once
    assert staged["losses"][-1] != staged["losses"][0]
