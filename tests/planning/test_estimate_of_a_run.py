"""`meshkit estimate CONFIG` against the run that config starts, on this CPU: the estimate's total is within ±10 %
of the peak the run's own summary measures (the training loop's peak RSS over the RSS at `prepare()`, the
largest rank's) — for the demo's `meshkit train` (4 ranks, dp 2 × tp 2 with sequence parallel) and for a
`meshkit finetune` of a model whose logits lead its memory, with the plain loss and with the fused one."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.cli import ROOT, meshkit
from tests.helpers.cli import meshkit_here as meshkit_here
from tests.helpers.distributed import run_world

WORDS = ["apple", "river", "stone", "cloud", "garden", "silver", "window", "forest", "candle", "market"]
TOLERANCE = 0.10


def _estimated_mb(config: Path, *flags: str) -> float:
    done = meshkit_here("estimate", str(config), *flags, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)["total_gb"] * 1e3


def _added_mb(memory: list[dict[str, int]]) -> float:
    return max(rank["train_peak_rss"] - rank["start_rss"] for rank in memory) / 1e6


def test_the_demos_estimate_is_its_measured_peak(tmp_path) -> None:
    demo = ROOT / "examples" / "demo.yaml"
    done = meshkit("train", str(demo), "train.steps=4", "train.log_every=2", f"logging.dir={tmp_path}", timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    added = _added_mb(json.loads((tmp_path / "summary.json").read_text())["memory"])
    estimated = _estimated_mb(demo)
    assert abs(added / estimated - 1) <= TOLERANCE, f"measured {added:.0f} MB, estimated {estimated:.0f} MB"


def _logits_heavy_config(root: Path, **keys: Any) -> Path:
    """A 2-layer Llama with a 32,768-row head (its tokenizer knows 320 tokens), one 1,024-token row per step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshkit.recipes.tiny_model import make_tokenizer

    base = root / "base"
    if not base.exists():
        import torch

        tokenizer = make_tokenizer([" ".join(WORDS)] * 50, 320)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=32768, max_position_embeddings=1024,
                             tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(base)
        tokenizer.save_pretrained(base)
        rows = [{"text": _text_of(tokenizer, 1000, seed)} for seed in range(2)]
        (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    name = "-".join(f"{key}-{value}" for key, value in keys.items()) or "default"
    config_path = root / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump({
        "base_model": str(base), "datasets": [{"path": str(root / "rows.jsonl"), "type": "completion"}],
        "sequence_len": 1024, "micro_batch_size": 1, "max_steps": 2, "learning_rate": 1e-3,
        "optimizer": "adamw_torch", "output_dir": str(root / name), "generation_samples": 0, **keys,
    }))  # fmt: skip
    return config_path


def _text_of(tokenizer: Any, tokens: int, seed: int) -> str:
    """Words whose tokens number at most `tokens` (and nearly that)."""
    words = [random.Random(seed).choice(WORDS) for _ in range(2 * tokens)]
    while len(tokenizer(" ".join(words))["input_ids"]) > tokens:
        words = words[: int(len(words) * 0.97)]
    return " ".join(words)


def _memory_of(rank: int, config: str) -> list[dict[str, int]]:
    from meshkit.recipes.finetune import finetune
    from meshkit.recipes.finetune_config import resolve_finetune

    return finetune(resolve_finetune(config, []))["memory"]


@pytest.mark.parametrize("loss", ["off", "auto"])
def test_a_finetune_configs_estimate_is_its_measured_peak(tmp_path, loss) -> None:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    config = _logits_heavy_config(tmp_path, fused_loss=loss)
    added = _added_mb(run_world(_memory_of, 1, str(config), timeout=240)[0])
    estimated = _estimated_mb(config)
    assert abs(added / estimated - 1) <= TOLERANCE, f"measured {added:.0f} MB, estimated {estimated:.0f} MB"
