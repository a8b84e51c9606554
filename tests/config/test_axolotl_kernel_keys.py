"""Axolotl's memory and kernel keys as written: older names, NEFTune, tiled MLP, Liger's kernels, and the fused
cross-entropy keys and plugins, each honoured as meshkit's own setting."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from meshkit.recipes.finetune_config import resolve_finetune  # noqa: E402
from tests.config.test_axolotl_configs import _write, axolotl_lora  # noqa: E402


def test_older_names_and_more_honoured_keys(tmp_path, material) -> None:
    keys = {"type_of_model": "LlamaForCausalLM", "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "selective_checkpointing": True, "chat_template_kwargs": {"enable_thinking": False},
            "model_config": {"rms_norm_eps": 1e-5}, "noisy_embedding_alpha": 5.0, "tiled_mlp": True,
            "tiled_mlp_num_shards": 4, "liger_rope": True, "liger_rms_norm": True}  # fmt: skip
    job = resolve_finetune(_write(tmp_path / "o.yml", axolotl_lora(material, tmp_path, **keys)), [], env={})
    s = job.settings
    assert s.model_type == "LlamaForCausalLM" and s.chat_template_kwargs == {"enable_thinking": False}
    assert s.overrides_of_model_config == {"rms_norm_eps": 1e-5} or "rope_scaling" in s.overrides_of_model_config
    assert job.resolved.config.activation_checkpointing.mode == "selective"
    assert job.resolved.config.neftune_noise_alpha == 5.0  # (NEFTune, by Axolotl's older name)
    assert job.resolved.config.tiled_mlp and job.resolved.config.tiled_mlp_shards == 4
    assert (
        s.liger_rope and s.liger_rms_norm and not s.liger_layer_norm
    )  # (applied on CUDA: tests/recipes/test_liger.py)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"], "cut_cross_entropy": True},
         "auto"),
        ({"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_fused_linear_cross_entropy": True}, "auto"),
        ({"chunked_cross_entropy": True, "chunked_cross_entropy_num_chunks": 8}, "auto"),
        ({"cut_cross_entropy": False}, "off"),
    ],
    ids=["cut-cross-entropy", "liger", "chunked", "off"],
)  # fmt: skip
def test_fused_cross_entropy_keys_and_plugins_are_meshkits_fused_loss(tmp_path, material, keys, expected) -> None:
    job = resolve_finetune(_write(tmp_path / "f.yml", axolotl_lora(material, tmp_path, **keys)), [], env={})
    assert job.resolved.config.fused_loss == expected
    assert job.resolved.sources["fused_loss"].endswith(tuple(f"({name})" for name in keys))
    notes = [note.split(" (")[0] for note in job.notes if "cross_entropy" in note or "plugins" in note]
    assert notes == (["chunked_cross_entropy_num_chunks: 8"] if "chunked_cross_entropy_num_chunks" in keys else [])
