"""The estimator's activation count for modern decoders (GQA, gated MLPs, routed experts, fused attention) against
the bytes autograd really saves (saved-tensor hooks, `planning.activation_report`) in transformers' Llama, Qwen2
and Mixtral on CPU, at three sequence lengths, in fp32 and under bf16 autocast: within ±10 % per layer."""

from __future__ import annotations

import contextlib

import pytest
import torch

from meshkit.planning.activation_report import ActivationReport
from meshkit.planning.estimate import ModelShape, estimate_memory

transformers = pytest.importorskip("transformers")
COMMON = {
    "vocab_size": 512,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "max_position_embeddings": 1024,
}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"intermediate_size": 344, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}


def measured_layer_bytes(model: torch.nn.Module, seq_len: int, autocast: bool) -> float:
    """Bytes the second block saves for backward (the first also holds what the blocks share). Autocast caches the
    bf16 copies of the block's linear weights as saved tensors: those are not activations and are taken off."""
    ids = torch.randint(0, 512, (1, seq_len), generator=torch.Generator().manual_seed(0))
    report = ActivationReport([model], [], "model.layers")
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with report, context:
        model(input_ids=ids, labels=ids).loss.backward()
    saved = report.as_dict()["blocks"]["model.layers.1"]["saved_bytes"]
    if autocast:
        linear = (m.weight for m in model.model.layers[1].modules() if isinstance(m, torch.nn.Linear))
        saved -= 2 * sum(weight.numel() for weight in linear)
    return saved


@pytest.mark.parametrize("family", list(FAMILIES))
def test_activations_per_layer_within_10_percent_of_measured(tmp_path, family: str) -> None:
    config_class, model_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra}, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = model_class(config)
    path = tmp_path / "config.json"
    config.to_json_file(path)
    shape = ModelShape.from_hf_config(path)
    for seq_len in (128, 256, 512):
        for autocast, precision in ((False, "fp32"), (True, "bf16")):
            found = measured_layer_bytes(model, seq_len, autocast)
            estimate = estimate_memory(shape, seq_len=seq_len, precision=precision, pp=2).gb("activations") * 1e9
            per_layer = estimate / shape.layers  # (pp > 1: no logits term; the first stage holds L layers' worth)
            assert abs(per_layer - found) / found <= 0.10, (family, seq_len, precision, per_layer, found)


def test_eager_attention_keeps_its_probabilities() -> None:
    fused = ModelShape.transformer(layers=2, hidden=256, heads=8, vocab=0, ffn=688, kv_heads=2)
    eager = ModelShape(**{**vars(fused), "fused_attention": False})
    grow = [estimate_memory(m, seq_len=1024, precision="fp32", pp=2).gb("activations") for m in (fused, eager)]
    per_token = 4 * (8 * 1024 + 2 * (256 - 64)) - 4 * 8  # fp32 probabilities and repeated k/v, less the lse
    assert grow[1] - grow[0] == pytest.approx(2 * 1024 * per_token / 1e9)
