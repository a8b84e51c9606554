"""Whether a causal LM's logits are its head's output as it is (`models/logits_head.py`), learnt from how they are
made: the same answer on real weights and on the meta device (every `meshkit finetune` builds there), and a reason
in words where the answer is no."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshkit.models.logits_head import logits_head
from meshkit.models.structure import describe

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_models import config  # noqa: E402

PLAIN = ("llama", "gpt2", "qwen3", "mistral")
CHANGED = ("gemma2", "granite")  # (gemma2 soft-caps its logits; granite divides them by logits_scaling)


def _built(family: str, device: str, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config(family, **overrides), dtype=dtype)


@pytest.mark.parametrize("family", PLAIN + CHANGED)
def test_the_meta_device_gives_the_answer_real_weights_give(family: str) -> None:
    overrides = {"logits_scaling": 4.0} if family == "granite" else {}
    real, meta = _built(family, "cpu", **overrides), _built(family, "meta", **overrides)
    found = {name: logits_head(model, describe(model, None, None)) for name, model in (("cpu", real), ("meta", meta))}
    assert found["cpu"] == found["meta"]
    if family in PLAIN:
        assert found["meta"].name == "lm_head" and found["meta"].why_not is None
    else:
        assert found["meta"].name is None
        assert "changes its head's output on the way to its logits" in (found["meta"].why_not or "")


def test_a_mixture_of_experts_model_in_fp32_is_answered_on_the_meta_device_and_keeps_its_dtypes() -> None:
    model = _mixtral_meta()
    before = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    assert logits_head(model, describe(model, None, None)).name == "lm_head"
    assert {name: tensor.dtype for name, tensor in model.state_dict().items()} == before


def test_a_head_that_is_not_a_plain_linear_layer_is_named_in_the_reason() -> None:
    model = _built("llama", "cpu")
    model.lm_head = torch.nn.Sequential(model.lm_head)  # (e.g. a quantized or adapted head)
    model.get_output_embeddings = lambda: model.lm_head  # type: ignore[method-assign]
    found = logits_head(model, describe(model, None, None))
    assert found.name is None and "not a plain linear layer" in (found.why_not or "")


def _mixtral_meta() -> Any:
    settings = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**settings))
