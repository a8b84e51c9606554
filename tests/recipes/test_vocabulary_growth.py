"""Tokens added by `special_tokens` / `tokens` beyond the embedding's rows: the embedding and head grow, the new
rows start as the mean of the checkpoint's (as the weights stream into a meta-built, sharded model), they train
in a full fine-tune and, through lora_modules_to_save, under LoRA, where ZeRO-3 at world 2 equals one process; the
merged export loads with the grown vocabulary."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from meshkit.parallel.materialize import grown_rows  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config, write_jsonl  # noqa: E402

NEW_TOKENS = ["<|tool|>", "<|result|>"]


def test_grown_rows_are_the_mean_of_the_stored_ones() -> None:
    stored = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    grown = grown_rows(stored, 4)
    assert torch.equal(grown[:2], stored) and torch.equal(grown[2:], torch.tensor([[2.0, 4.0], [2.0, 4.0]]))
    assert grown_rows(stored, 2) is stored


def _records() -> list[dict]:
    words = ["apple", "river", "stone", "cloud", "garden", "silver"]
    return [
        {"instruction": f"Call the tool on {w}.", "input": "", "output": f"<|tool|> {w} <|result|> {w.upper()}"}
        for w in words * 3
    ]


def _run(tmp_path, material, world: int, name: str, **keys) -> dict:
    data = write_jsonl(tmp_path / "tools.jsonl", _records())
    config = write_config(
        tmp_path / f"{name}.yaml",
        material,
        datasets=[{"path": str(data), "type": "alpaca"}],
        tokens=NEW_TOKENS,
        special_tokens={"pad_token": "<pad>"},
        **{"learning_rate": 1e-3, "max_steps": 3, **keys},
    )
    return run_world(run_finetune, world, str(config), [f"output_dir={tmp_path / name}"], timeout=240)[0]


def test_added_tokens_grow_the_embedding_train_and_export(tmp_path, material) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(material["base"])
    rows = base.get_input_embeddings().num_embeddings
    two = _run(tmp_path, material, 2, "two", zero_stage=3)  # world 2 = world 1: the LoRA test below
    merged = AutoModelForCausalLM.from_pretrained(two["outputs"]["merged"])
    tokenizer = AutoTokenizer.from_pretrained(two["outputs"]["merged"])
    assert merged.get_input_embeddings().num_embeddings == rows + 2 == len(tokenizer)
    assert tokenizer.convert_tokens_to_ids(NEW_TOKENS) == [rows, rows + 1]
    grown = merged.get_input_embeddings().weight[rows:]
    start = base.get_input_embeddings().weight.mean(dim=0)
    assert not torch.allclose(grown[0], start)  # trained away from the mean it started at
    torch.testing.assert_close(merged.get_input_embeddings().weight[:rows].mean(0), start, atol=0.05, rtol=0)
    with torch.no_grad():
        logits = merged(torch.tensor([tokenizer("<|tool|> apple").input_ids])).logits
    assert logits.shape[-1] == rows + 2 and torch.isfinite(logits).all()


@pytest.mark.slow
def test_lora_trains_the_new_rows_through_modules_to_save_and_continues_them(tmp_path, material) -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    keys = lora_keys(lora_modules_to_save=["embed_tokens", "lm_head"])
    one = _run(tmp_path, material, 1, "one", micro_batch_size=4, **keys)
    two = _run(tmp_path, material, 2, "two", zero_stage=3, **keys)
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    adapter = two["outputs"]["adapter"]
    with safe_open(f"{adapter}/adapter_model.safetensors", "pt") as handle:
        assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= set(handle.keys())
    merged = AutoModelForCausalLM.from_pretrained(two["outputs"]["merged"])
    base = AutoModelForCausalLM.from_pretrained(material["base"])
    rows = base.get_input_embeddings().num_embeddings
    assert not torch.allclose(merged.get_input_embeddings().weight[rows], base.get_input_embeddings().weight.mean(0))
    base.resize_token_embeddings(rows + 2)
    ids = torch.tensor([[1, rows, 40, rows + 1, 50]])
    with torch.no_grad():
        expected = PeftModel.from_pretrained(base, adapter)(ids).logits
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-4, atol=1e-4)

    later = _run(tmp_path, material, 1, "later", learning_rate=1e-12, max_steps=1, lora_model_dir=adapter, **keys)
    continued = AutoModelForCausalLM.from_pretrained(later["outputs"]["merged"]).get_input_embeddings().weight
    torch.testing.assert_close(continued, merged.get_input_embeddings().weight, rtol=0, atol=1e-6)
