"""Preference training's cost by reference-model choice: DPO with LoRA (reference = the base with adapters off),
full DPO with a frozen copy, full DPO with the reference scored once before training, against SFT of the same
pairs' chosen replies (twice the micro-batch: as many rows per forward as a pair batch) — tokens/s (every token a
step puts through the policy, both rows of a pair) and peak RSS per rank, through `meshkit finetune` at world 2.

A Llama-style base (made offline, random init, BPE tokenizer trained on the example data) and the example pairs
(examples/finetune/pairs.jsonl). The runs go one after another on the same machine; compare the ratios.

    python bench/preference.py [--nproc 2] [--steps 30] [--out bench/results/preference-w2.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from meshkit.recipes.tiny_model import make_tiny_base_model, texts_of_jsonl

HERE = Path(__file__).resolve().parent
PAIRS = HERE.parent / "examples/finetune/pairs.jsonl"
HIDDEN, LAYERS, SEQ_LEN, MICRO_BATCH = 768, 6, 128, 4
RUNS = {  # name -> recipe keys over the common ones
    "sft (chosen replies)": {"datasets": "sft", "micro_batch_size": 2 * MICRO_BATCH},  # (as many rows per forward)
    "dpo, LoRA (adapters off)": {
        "rl": "dpo",
        "adapter": "lora",
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_target_linear": True,
    },  # noqa: E501
    "dpo, full (frozen copy)": {"rl": "dpo"},
    "dpo, full (precomputed)": {"rl": "dpo", "precompute_ref_log_probs": True},
}


def _sft_records(root: Path) -> Path:
    """The pairs' conversations with their chosen replies, as chat SFT records."""
    path = root / "sft.jsonl"
    lines = []
    for line in PAIRS.read_text().splitlines():
        pair = json.loads(line)
        messages = [*pair["conversation"], {"role": "assistant", "content": pair["chosen"]}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(root: Path, base: Path, name: str, keys: dict[str, Any], steps: int, nproc: int) -> Path:
    if keys.get("datasets") == "sft":
        datasets = [{"path": str(_sft_records(root)), "type": "chat_template"}]
    else:
        datasets = [{"path": str(PAIRS), "type": "chat_template.default", "field_messages": "conversation"}]
    config = {
        "base_model": str(base), "chat_template": "chatml", "sequence_len": SEQ_LEN, "micro_batch_size": MICRO_BATCH,
        "max_steps": steps, "learning_rate": 1e-4, "lr_scheduler": "constant", "optimizer": "adamw_torch",
        "output_dir": str(root / name.split(" ")[0] / str(abs(hash(name)))), "generation_samples": 0,
        "logging_steps": 10, "seed": 0, "meshkit": {"launch": {"nproc_per_node": nproc}},
        **{k: v for k, v in keys.items() if k != "datasets"}, "datasets": datasets,
    }  # fmt: skip
    path = root / f"{abs(hash(name))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(config: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "meshkit.cli", "finetune", str(config)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{config}: meshkit finetune failed:\n{proc.stderr[-3000:]}")
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    return json.loads((out / "summary.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "preference-w2.json")
    args = parser.parse_args(argv)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="meshkit-bench-preference-") as tmp:
        root = Path(tmp)
        texts = list(texts_of_jsonl([PAIRS, HERE.parent / "examples/finetune/chat.jsonl"]))
        base = make_tiny_base_model(
            root / "base", texts, vocab_size=800, hidden_size=HIDDEN, layers=LAYERS, heads=4, kv_heads=2
        )  # noqa: E501
        for name, keys in RUNS.items():
            summary = _run(_config(root, base, name, keys, args.steps, args.nproc))
            peaks = [rank["peak_rss"] / 2**20 for rank in summary["memory"]]
            rows[name] = {
                "tokens_per_s": summary["tokens_per_s"],
                "peak_rss_mb": max(peaks),
                "final_loss": summary["final_loss"],
                "accuracy": summary.get("final_metrics", {}).get("rewards/accuracies"),
            }
            print(f"{name:28s} {rows[name]['tokens_per_s']:10,.0f} tok/s  peak RSS {rows[name]['peak_rss_mb']:8.1f} MB")
    sft = rows["sft (chosen replies)"]
    for row in rows.values():
        row["tokens_per_s_vs_sft"] = row["tokens_per_s"] / sft["tokens_per_s"]
        row["peak_rss_vs_sft"] = row["peak_rss_mb"] / sft["peak_rss_mb"]
    result = {
        "date": datetime.date.today().isoformat(), "world_size": args.nproc, "steps": args.steps,
        "hidden": HIDDEN, "layers": LAYERS, "sequence_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "runs": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'run':28s} {'tokens/s':>10s} {'vs SFT':>7s} {'peak RSS MB':>12s} {'vs SFT':>7s}")
    for name, row in rows.items():
        print(
            f"{name:28s} {row['tokens_per_s']:10,.0f} {row['tokens_per_s_vs_sft']:7.2f} {row['peak_rss_mb']:12.1f} "
            f"{row['peak_rss_vs_sft']:7.2f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
