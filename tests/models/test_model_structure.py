"""The model-structure layer: what every strategy learns about a model, and the refusals it makes possible."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshkit import Engine
from meshkit.config import StructureConfig
from meshkit.engine import WrappedModelWarning
from meshkit.models.blocks import block_units, find_blocks
from meshkit.models.structure import StructureError, describe
from meshkit.parallel.pipeline.stages import PipelineError, split_model
from meshkit.parallel.tensor.apply import check_heads
from meshkit.parallel.tensor.auto import TensorParallelError
from meshkit.training.loss import IGNORE_INDEX, LossError, split_causal_lm_batch
from tests.helpers.hf_models import FAMILIES, causal_lm, config, transformers
from tests.helpers.training import tiny_gpt

TIED = {"gpt2", "gemma", "gemma2", "gemma3"}  # tie_word_embeddings by default in these families


def mlp_stack() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_models_are_described_from_their_structure_and_config(family: str) -> None:
    structure = describe(causal_lm(family))
    base = "transformer" if family == "gpt2" else "model"
    assert structure.family == {"gemma3": "gemma3_text"}.get(family, family) and structure.causal_lm
    assert structure.blocks == f"{base}.{'h' if family == 'gpt2' else 'layers'}"
    assert structure.first_stage[0] == f"{base}.{'wte' if family == 'gpt2' else 'embed_tokens'}"
    assert structure.last_stage == (f"{base}.{'ln_f' if family == 'gpt2' else 'norm'}", "lm_head")
    assert structure.stage_style == "hf" and structure.position_argument == "position_ids"
    assert len(structure.attention) == 4  # one per layer
    expected_kv = 4 if family == "gpt2" else 2  # GPT-2 has no grouped-query attention
    assert structure.head_counts() == {"heads": 4, "kv_heads": expected_kv}
    assert bool(structure.tied) == (family in TIED)
    if family in TIED:
        assert set(structure.aliases().values()) == {structure.first_stage[0] + ".weight"}
    assert structure.notes == {}  # sliding windows, soft-capped logits: ring attention computes them all
    assert dict(structure.training_inputs) == {"use_cache": False}  # no cache in training: packed rows stay apart


def test_norms_over_a_whole_projection_are_told_from_per_head_norms() -> None:
    """OLMo-2 normalises all query (key) heads at once: under tp its norm is split with them. Qwen3's norm each
    head alone and stay whole."""
    olmo2, qwen3 = describe(causal_lm("olmo2")), describe(causal_lm("qwen3"))
    assert {facts.projection_norms for facts in olmo2.attention} == {("q_norm", "k_norm")}
    assert {facts.projection_norms for facts in qwen3.attention} == {()}


def test_blocks_that_mix_tokens_without_attention_refuse_context_parallel() -> None:
    from tests.helpers.moe_models import moe_causal_lm

    note = describe(moe_causal_lm("qwen3_next")).notes["cp"]  # a linear-attention layer beside attention layers
    assert "mixes tokens without attention in 1 of its blocks, e.g. model.layers.0 (linear_attention)" in note
    mamba = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4)
    assert "in 2 of its blocks" in describe(transformers.AutoModelForCausalLM.from_config(mamba)).notes["cp"]


def test_a_final_norm_registered_before_the_blocks_is_placed_after_them() -> None:
    found = describe(causal_lm("opt"))  # OPT registers final_layer_norm before its layers
    assert found.first_stage == ("model.decoder.embed_tokens", "model.decoder.embed_positions")
    assert found.last_stage == ("model.decoder.final_layer_norm", "lm_head")


def test_chunked_attention_shorter_than_the_context_refuses_context_parallel() -> None:
    settings = dict(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Llama4TextConfig(**settings, attention_chunk_size=16)
    )
    assert "attends within chunks of 16 tokens" in describe(model).notes["cp"]
    whole = transformers.AutoModelForCausalLM.from_config(
        transformers.Llama4TextConfig(**settings, attention_chunk_size=64)
    )
    assert "cp" not in describe(whole).notes  # a chunk as long as the context is full attention


def test_a_sequential_stack_is_its_own_block_list_with_the_linear_layers_as_units() -> None:
    model = mlp_stack()
    structure = describe(model)
    assert structure.blocks == "" and structure.stage_style == "sequential"
    path, container = find_blocks(model)
    assert path == "" and container is model
    assert [index for index, _ in block_units(container)] == [0, 2, 4]


def test_the_reference_gpt_keeps_its_own_description() -> None:
    structure = describe(tiny_gpt())
    assert structure.blocks == "layers" and structure.first_stage == ("tok_embeddings",)
    assert structure.position_argument == "positions" and structure.stage_style == "skip_none"


class Nested(nn.Module):
    """A user's model with its blocks in a ModuleList but nothing that says what runs before and after them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x) if block is not None else x
        return self.head(x)


def test_a_pipeline_of_an_unknown_model_names_the_override() -> None:
    structure = describe(Nested())
    with pytest.raises(PipelineError, match=r"name them in structure.first_stage / structure.last_stage"):
        split_model(Nested(), [0], 2, structure)
    overridden = describe(Nested(), override=StructureConfig(first_stage=["embed"], last_stage=["head"]))
    assert overridden.stage_style == "skip_none" and overridden.first_stage == ("embed",)


def test_overrides_that_name_what_the_model_lacks_are_refused() -> None:
    with pytest.raises(StructureError, match=r"structure names module 'norm', which Nested does not have"):
        describe(Nested(), override=StructureConfig(last_stage=["norm"]))
    with pytest.raises(StructureError, match=r"has no argument 'pos' \(structure.position_argument\)"):
        describe(Nested(), override=StructureConfig(position_argument="pos"))


def test_tp_is_checked_against_the_head_counts_in_the_config_before_anything_is_split() -> None:
    model = causal_lm("llama")  # 4 query heads, 2 key/value heads (counts live in model.config)
    with pytest.raises(
        TensorParallelError,
        match=r"tp=4 does not divide the attention's head counts \(heads=4, kv_heads=2\): choose tp 1 or 2$",
    ):
        check_heads(model, 4)
    check_heads(model, 2)


def test_phi3s_fused_layers_are_checked_like_any_attention() -> None:
    phi3 = causal_lm("phi3")  # (its fused q/k/v and gate/up are split by their parts' sizes)
    check_heads(phi3, 2)
    with pytest.raises(TensorParallelError, match=r"tp=4 does not divide the attention's head counts"):
        check_heads(phi3, 4)


def test_causal_lm_batches_shift_their_labels_once_and_drop_right_padding() -> None:
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    inputs, targets = split_causal_lm_batch({"input_ids": ids, "labels": ids.clone(), "attention_mask": mask})
    assert set(inputs) == {"input_ids"}
    ignored = IGNORE_INDEX
    assert targets.tolist() == [[6, 7, 8, ignored], [6, ignored, ignored, ignored]]
    with pytest.raises(LossError, match=r"attention_mask has a pad before a real token: pad on the right"):
        split_causal_lm_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1]] * 2)})


def test_a_data_parallel_wrapped_model_is_unwrapped_with_a_warning() -> None:
    inner = mlp_stack()
    with Engine() as engine, pytest.warns(WrappedModelWarning, match=r"got a model wrapped in DataParallel"):
        prepared = engine.prepare(nn.DataParallel(inner))
    assert not isinstance(prepared, nn.DataParallel)
    assert {id(p) for p in prepared.parameters()} == {id(p) for p in inner.parameters()}


def test_a_classifier_batch_with_labels_keeps_the_models_own_loss() -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config("llama", num_labels=3))
    assert not describe(model).causal_lm
    batch = {"input_ids": torch.randint(3, 60, (2, 8)), "labels": torch.tensor([0, 2])}
    with Engine() as engine:
        model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        expected = model(**batch).loss.detach()
        loss = engine.train_step(batch)  # not the causal-LM loss: the labels are classes, not next tokens
    assert torch.allclose(loss, expected)
