"""Fine-tuning test material, made offline: JSONL data written here, a tiny Llama base model with a BPE
tokenizer trained on it, recipe configs, and the rank function that runs the recipe in a spawned world."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import yaml

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "garden",
    "silver",
    "window",
    "forest",
    "candle",
    "market",
    "pocket",
    "rocket",
]


def alpaca_records(count: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        word = rng.choice(WORDS)
        if i % 2:
            records.append({"instruction": "Reverse the word.", "input": word, "output": word[::-1]})
        else:
            a, b = rng.randint(1, 30), rng.randint(1, 30)
            records.append({"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)})
    return records


def chat_records(count: int, seed: int = 1) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        word = rng.choice(WORDS)
        messages = [{"role": "user", "content": f"Shout {word}"}, {"role": "assistant", "content": word.upper()}]
        if i % 2:
            messages.insert(0, {"role": "system", "content": "Be brief."})
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def make_material(root: Path) -> dict[str, Path]:
    """alpaca.jsonl, chat.jsonl, completion.jsonl and a base model directory under `root`."""
    from meshkit.recipes.tiny_model import make_tiny_base_model, texts_of_jsonl

    files = {
        "alpaca": write_jsonl(root / "alpaca.jsonl", alpaca_records(32)),
        "chat": write_jsonl(root / "chat.jsonl", chat_records(24)),
        "completion": write_jsonl(root / "completion.jsonl", [{"text": f"the {w} is here"} for w in WORDS]),
    }
    files["base"] = make_tiny_base_model(
        root / "base", texts_of_jsonl(files.values()), vocab_size=320, hidden_size=32, layers=2, heads=4, kv_heads=2
    )
    return files


def write_config(path: Path, material: dict[str, Path], **keys: Any) -> Path:
    """A recipe YAML: the alpaca data on the tiny base model, 4 steps, overridden by `keys`."""
    config: dict[str, Any] = {
        "base_model": str(material["base"]),
        "datasets": [{"path": str(material["alpaca"]), "type": "alpaca"}],
        "sequence_len": 256,
        "micro_batch_size": 2,
        "learning_rate": 0.01,
        "max_steps": 4,
        "output_dir": str(path.parent / "out"),
        "generation_samples": 0,
        **keys,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def run_finetune(rank: int, config: str, assignments: list[str]) -> dict[str, Any]:
    """In a spawned rank: the recipe on `config`; returns its summary."""
    from meshkit.recipes.finetune import finetune
    from meshkit.recipes.finetune_config import resolve_finetune

    summary = finetune(resolve_finetune(config, assignments))
    keep = (
        "losses",
        "evals",
        "outputs",
        "trainable_parameters",
        "resumed_at_step",
        "layout",
        "layout_description",
        "zero_stage",
        "device",
        "attention",
        "ran",
        "memory",
    )
    return {key: summary[key] for key in keep if key in summary}


def lora_keys(**extra: Any) -> dict[str, Any]:
    return {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True, **extra}


def make_gpt2_base(root: Path, material: dict[str, Path]) -> Path:
    """A tiny GPT-2 (tied head, Conv1D layers, fused q/k/v) with the Llama base's tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(material["base"])
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    out = root / "gpt2-base"
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_moe_base(root: Path, material: dict[str, Path]) -> Path:
    """A tiny Mixtral (4 experts, top-2) with the Llama base's tokenizer."""
    import torch
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(material["base"])
    config = MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    out = root / "mixtral-base"
    MixtralForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
