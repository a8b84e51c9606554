"""What Axolotl's own example configs met (bench/axolotl_examples.py), each fixed by its mechanism: a kernel that
cannot run here falls back to the model's own default attention (Gemma-2 has no sdpa; flex attention has no CPU
backward), `warmup_steps` under 1 is a share of the steps (transformers 5), 0 evaluations per epoch means none, and
a head with a bias (Phi's) grows a row per added token like its weight."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.recipes.finetune_config import resolve_finetune  # noqa: E402
from meshkit.recipes.hf_base import attention_implementation  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import run_finetune, write_config  # noqa: E402


def test_an_attention_kernel_that_cannot_run_here_gives_way_to_the_models_default() -> None:
    assert attention_implementation("flex_attention", "cpu")[0] is None
    assert "no backward on a CPU" in str(attention_implementation("flex_attention", "cpu")[1])
    assert attention_implementation("flex_attention", "cuda") == ("flex_attention", None)
    assert attention_implementation("sdpa", "cpu") == ("sdpa", None)
    implementation, note = attention_implementation("flash_attention_3", "cpu")
    assert implementation is None and "needs flash-attn" in str(note)  # (flash-attn is not installed here)
    implementation, note = attention_implementation("xformers", "cpu")  # (Axolotl patches it in: 7 examples)
    assert implementation is None and "not an attention transformers has here" in str(note)
    implementation, note = attention_implementation("kernels-community/vllm-flash-attn3", "cuda")
    assert implementation is None and "hub kernel" in str(note)


def test_a_fractional_warmup_is_a_share_and_zero_evaluations_are_none(tmp_path, material) -> None:
    path = write_config(tmp_path / "w.yaml", material, warmup_steps=0.25, evals_per_epoch=0, saves_per_epoch=0)
    job = resolve_finetune(path, [], env={})
    assert job.settings.warmup_ratio == 0.25 and job.resolved.config.train.warmup_steps == 0
    assert job.settings.evals_per_epoch is None and job.settings.saves_per_epoch is None
    whole = resolve_finetune(write_config(tmp_path / "s.yaml", material, warmup_steps=3), [], env={})
    assert whole.resolved.config.train.warmup_steps == 3 and whole.settings.warmup_ratio is None


def test_a_head_bias_grows_with_added_tokens(tmp_path, material) -> None:
    from transformers import AutoTokenizer, PhiConfig, PhiForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(material["base"])
    config = PhiConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    PhiForCausalLM(config).save_pretrained(tmp_path / "phi")
    tokenizer.save_pretrained(tmp_path / "phi")
    assert PhiForCausalLM.from_pretrained(tmp_path / "phi").lm_head.bias is not None
    config_path = write_config(tmp_path / "p.yaml", {**material, "base": tmp_path / "phi"}, tokens=["<|new|>"])
    summary = run_world(run_finetune, 1, str(config_path), [f"output_dir={tmp_path / 'out'}"], timeout=180)[0]
    merged = PhiForCausalLM.from_pretrained(summary["outputs"]["merged"])
    assert merged.lm_head.bias.shape[0] == len(tokenizer) + 1 and summary["losses"]


def test_plugin_keys_are_noted_or_refused_by_what_the_plugin_does(tmp_path, material) -> None:
    from meshkit.config.resolve import ConfigError

    noted = write_config(tmp_path / "k.yaml", material, use_scattermoe=True, liger_rms_norm_gated=True,
                         swanlab_project="p")  # fmt: skip
    job = resolve_finetune(noted, [], env={})
    assert len(job.notes) == 3 and any("use_scattermoe" in note for note in job.notes)
    with pytest.raises(ConfigError, match="diffusion language-model training is not supported"):
        resolve_finetune(write_config(tmp_path / "d.yaml", material, diffusion={"mask_token_id": 1}), [], env={})


def test_stepwise_keys_are_read_by_stepwise_entries_and_noted_elsewhere(tmp_path, material) -> None:
    entry = {"path": str(material["alpaca"]), "type": "alpaca", "max_completion_length": 64}
    job = resolve_finetune(write_config(tmp_path / "a.yaml", material, datasets=[entry]), [], env={})
    assert any("max_completion_length: 64" in note and "no effect here" in note for note in job.notes)
    assert job.settings.datasets[0].max_completion_length is None


def test_reinit_weights_starts_from_the_models_own_initialisation(tmp_path, material) -> None:
    """The checkpoint's weights are not read; the random start is the same on one rank and under ZeRO-3."""
    job = resolve_finetune(write_config(tmp_path / "r.yaml", material, reinit_weights=True), [], env={})
    assert job.resolved.config.sharding.init_from is None
    first_loss = {}
    for world, extra in ((1, []), (2, ["zero_stage=3"])):
        (tmp_path / f"w{world}").mkdir()
        path = write_config(
            tmp_path / f"w{world}" / "r.yaml",
            material,
            reinit_weights=True,
            max_steps=1,
            learning_rate=1e-9,
            micro_batch_size=2 // world,
        )  # fmt: skip  (the same two samples)
        summary = run_world(run_finetune, world, str(path), extra, timeout=240)[0]
        first_loss[world] = summary["losses"][0]
    (tmp_path / "p").mkdir()
    plain = run_world(run_finetune, 1, str(write_config(tmp_path / "p" / "p.yaml", material, max_steps=1)), [],
                      timeout=240)[0]  # fmt: skip
    assert first_loss[1] == pytest.approx(first_loss[2], rel=1e-5)
    assert abs(first_loss[1] - plain["losses"][0]) > 1e-3  # (not the checkpoint's weights)
