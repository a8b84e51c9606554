"""Memory where the logits or the MLP's activations dominate, measured on the path users run: `meshkit finetune`
on a saved model and an Axolotl-style config, one process, fp32, on this CPU. Each row is one run; its peak
resident memory (RSS) and its loss path come from the run's own summary.json (`memory`, `ran`).

- head: a tiny Llama with Llama-3's vocabulary (hidden 64, 2 layers, vocab 131,072) on one 2,048-token completion
  row — full, LoRA — and DPO on one pair of 1,024-token answers: the logits ([2048, 131072] fp32 = 1.07 GB, and
  their gradient) are nearly all of the step's memory. Modes: `plain` (fused_loss: off), `fused` (the default).
- mlp: a Llama with a wide MLP (hidden 128, intermediate 2,048) on one 16,384-token row: the MLP's intermediate
  activations lead. Modes: `whole`, `tiled` (tiled_mlp: true).
- neftune: the same model on a 2,048-token row with and without NEFTune's noise (neftune_noise_alpha: 5): what it
  costs, and that the run's record says it ran (its losses differ by the noise, as they should).

The step time is the median of the steps after the first (from the run's metrics.jsonl). Prints a table and writes
JSON.

    python bench/loss_memory.py [--steps 4] [--only head/dpo ...] [--out bench/results/loss-memory.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ["apple", "river", "stone", "cloud", "garden", "silver", "window", "forest", "candle", "market", "pocket"]
HEAD = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=131072)  # fmt: skip
MLP = dict(hidden_size=128, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=1024)  # fmt: skip
SCENARIOS: dict[str, dict[str, Any]] = {
    "head/full": {"model": HEAD, "seq": 2048, "data": "completion", "keys": {},
                  "modes": {"plain": {"fused_loss": "off"}, "fused": {}}},
    "head/lora": {"model": HEAD, "seq": 2048, "data": "completion",
                  "keys": {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True},
                  "modes": {"plain": {"fused_loss": "off"}, "fused": {}}},
    "head/dpo": {"model": HEAD, "seq": 2048, "data": "pairs", "keys": {"rl": "dpo", "rl_beta": 0.1,
                 "chat_template": "chatml", "sequence_len": 1056},  # (a row: the prompt and one ~1,008-token answer)
                 "modes": {"plain": {"fused_loss": "off"}, "fused": {}}},
    "mlp/full": {"model": MLP, "seq": 16384, "data": "completion", "keys": {},
                 "modes": {"whole": {}, "tiled": {"tiled_mlp": True}}},
    "neftune/full": {"model": MLP, "seq": 2048, "data": "completion", "keys": {},
                     "modes": {"off": {}, "alpha 5": {"neftune_noise_alpha": 5.0}}},
}  # fmt: skip


def make_base(out: Path, model: dict[str, Any], seq: int) -> Any:
    """A Llama of the given widths with a byte-level BPE tokenizer trained on the bench's words."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshkit.recipes.tiny_model import make_tokenizer

    tokenizer = make_tokenizer([" ".join(WORDS)] * 50, 320)
    config = LlamaConfig(**model, max_position_embeddings=seq, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return tokenizer


def text_of(tokenizer: Any, tokens: int, seed: int) -> str:
    """Words whose tokens number at most `tokens` (the tokenizer's own count)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens)]
    low, high = 1, len(words)
    while low < high:  # the most words that fit
        middle = (low + high + 1) // 2
        fits = len(tokenizer(" ".join(words[:middle]), add_special_tokens=False)["input_ids"]) <= tokens
        low, high = (middle, high) if fits else (low, middle - 1)
    return " ".join(words[:low])


def write_data(root: Path, tokenizer: Any, kind: str, seq: int) -> dict[str, Any]:
    """One completion row of nearly `seq` tokens, or one pair of answers of nearly `seq / 2` tokens each."""
    if kind == "completion":
        path = root / "rows.jsonl"
        path.write_text(json.dumps({"text": text_of(tokenizer, seq - 8, 1)}) + "\n")
        return {"path": str(path), "type": "completion"}
    path = root / "pairs.jsonl"
    answer = seq // 2 - 16
    pair = {"conversation": [{"role": "user", "content": "Say the words"}],
            "chosen": {"role": "assistant", "content": text_of(tokenizer, answer, 2)},
            "rejected": {"role": "assistant", "content": text_of(tokenizer, answer, 3)}}  # fmt: skip
    path.write_text(json.dumps(pair) + "\n")
    return {"path": str(path), "type": "chat_template.default", "field_messages": "conversation"}


def run_mode(root: Path, scenario: str, mode: str, steps: int) -> dict[str, Any]:
    """`meshkit finetune` of one mode; its peak RSS, step time, losses and loss path from summary.json."""
    spec = SCENARIOS[scenario]
    base = root / "base"
    out = root / f"out-{mode}"
    config = {"base_model": str(base), "datasets": [spec["dataset"]], "sequence_len": spec["seq"],
              "micro_batch_size": 1, "learning_rate": 1e-3, "max_steps": steps, "optimizer": "adamw_torch",
              "output_dir": str(out), "generation_samples": 0, "seed": 0, "logging_steps": 1,
              **spec["keys"], **spec["modes"][mode]}  # fmt: skip
    path = root / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "meshkit.cli", "finetune", str(path)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{scenario}/{mode} failed:\n{done.stderr[-3000:]}")
    estimate = subprocess.run([sys.executable, "-m", "meshkit.cli", "estimate", str(path), "--json"],
                              capture_output=True, text=True, check=False)  # fmt: skip
    estimated = json.loads(estimate.stdout)["total_gb"] * 1e3 if estimate.returncode == 0 else None
    summary = json.loads((out / "summary.json").read_text())
    times = [json.loads(line)["time"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]  # (the steps after the first)
    ran = summary["ran"]
    memory = summary["memory"][0]
    return {"peak_rss_mb": memory["peak_rss"] / 1e6, "step_s": statistics.median(steps),
            "added_mb": (memory["train_peak_rss"] - memory["start_rss"]) / 1e6, "estimate_mb": estimated,
            "losses": summary["losses"], "loss_path": ran["loss"], "tiled_mlp": ran["tiled_mlp"],
            "neftune": ran["neftune"]}  # fmt: skip


def run_scenario(scenario: str, steps: int) -> dict[str, dict[str, Any]]:
    spec = SCENARIOS[scenario]
    with tempfile.TemporaryDirectory(prefix="loss-memory-") as name:
        root = Path(name)
        tokenizer = make_base(root / "base", spec["model"], spec["seq"])
        spec["dataset"] = write_data(root, tokenizer, spec["data"], spec["seq"])
        return {mode: run_mode(root, scenario, mode, steps) for mode in spec["modes"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="scenarios to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/loss-memory.json"))
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for scenario in args.only or SCENARIOS:
        results[scenario] = run_scenario(scenario, args.steps)
        print(section_rows(scenario, results[scenario]), flush=True)
    data = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "steps": args.steps,
            "path": "meshkit finetune",
            "scenarios": {name: {"model": SCENARIOS[name]["model"], "seq": SCENARIOS[name]["seq"]} for name in results},
            "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def section_rows(scenario: str, modes: dict[str, dict[str, Any]]) -> str:
    baseline = next(iter(modes.values()))
    rows = []
    for mode, result in modes.items():
        drift = max(abs(a - b) for a, b in zip(result["losses"], baseline["losses"], strict=True))
        peak, step = result["peak_rss_mb"], result["step_s"]
        path = result.get("loss_path", "").split(" (")[0].split(":")[0]
        others = [f"{key} {result[key]}" for key in ("tiled_mlp", "neftune") if result.get(key, "off") != "off"]
        path = ", ".join([path, *(other.split(" over ")[0].replace("_", " ") for other in others)])
        added, estimate = result.get("added_mb"), result.get("estimate_mb")
        versus = f"{added:.0f} / {estimate:.0f} MB = {added / estimate:.2f}" if added and estimate else "—"
        rows.append(
            f"| {scenario} | {mode} | {path} | {peak:.0f} MB | {peak / baseline['peak_rss_mb']:.2f} "
            f"| {step * 1e3:.0f} ms | {step / baseline['step_s']:.2f} | {drift:.1e} | {versus} |"
        )
    return "\n".join(rows)


def section(data: dict[str, Any]) -> str:
    """The BENCHMARKS.md table (`bench/report.py`)."""
    head = (
        f"`{data.get('path', 'the Engine')}` on a saved model and config, one process, fp32, {data['steps']} steps per "
        "mode, each mode its own run; peak RSS and the loss path from the run's summary.json, the median step after "
        "the first; ratios against the "
        "first mode of each scenario; loss drift = largest absolute difference of a step's loss from it; added / "
        "estimate = the training loop's peak RSS over the RSS when prepare() began (libraries and data loaded) "
        "against `meshkit estimate CONFIG` of the same file.\n\n"
        "| scenario | mode | what ran | peak RSS | vs first | step | vs first | loss drift | added / estimate |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([head, *(section_rows(name, modes) for name, modes in data["results"].items())])


if __name__ == "__main__":
    raise SystemExit(main())
