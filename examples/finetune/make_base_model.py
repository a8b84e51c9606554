"""Make the small base model the fine-tuning examples start from, offline, the way a real base comes to be: a
BPE tokenizer trained on the example texts, a randomly initialised Llama-style model, then a short pretraining
(a full fine-tune through `meshkit finetune`, one process) on plain sentences stating the facts the instructions
ask about ("The word forest reversed is tserof."). The LoRA example then teaches the instruction format, and its
validation answers show what it learned.

    python examples/finetune/make_base_model.py            # writes examples/finetune/base/ (about a minute)
"""

import json
import shutil
import tempfile
from pathlib import Path

import yaml

from meshkit.recipes.finetune import finetune
from meshkit.recipes.finetune_config import resolve_finetune
from meshkit.recipes.tiny_model import make_tiny_base_model, texts_of_jsonl

HERE = Path(__file__).resolve().parent
PRETRAIN_EPOCHS = 150


def facts(instructions: Path) -> list[str]:
    """Plain sentences with the answers to the example's instructions, in several phrasings."""
    records = [json.loads(line) for line in instructions.read_text().splitlines() if line.strip()]
    lines = []
    for w in sorted({r["input"] for r in records if r["input"]}):
        lines += [
            f"The word {w} in capital letters is {w.upper()}.",
            f"The word {w} reversed is {w[::-1]}.",
            f"The word {w} three times is {w} {w} {w}.",
            f"Write {w} in capitals: {w.upper()}",
            f"Spell {w} backwards: {w[::-1]}",
            f"Say {w} three times: {w} {w} {w}",
            f"Word: {w}\nCapitals: {w.upper()}\nReversed: {w[::-1]}\nThree times: {w} {w} {w}",
        ]
    for r in records:
        if r["instruction"].startswith("Add "):
            a, b = r["instruction"].removeprefix("Add ").removesuffix(".").split(" and ")
            lines.append(f"{a} plus {b} is {r['output']}.")
    return lines


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        corpus = work / "pretrain.jsonl"
        corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in facts(HERE / "alpaca.jsonl")))
        texts = texts_of_jsonl([HERE / "alpaca.jsonl", HERE / "chat.jsonl", corpus])
        make_tiny_base_model(work / "random", texts, vocab_size=512, hidden_size=128, layers=4)
        pretrain = {
            "base_model": str(work / "random"),
            "datasets": [{"path": str(corpus), "type": "completion"}],
            "sequence_len": 64,
            "sample_packing": True,
            "micro_batch_size": 8,
            "num_epochs": PRETRAIN_EPOCHS,
            "learning_rate": 3e-3,
            "warmup_ratio": 0.05,
            "save_steps": 100_000,
            "generation_samples": 0,
            "output_dir": str(work / "pretrained"),
        }
        (work / "pretrain.yaml").write_text(yaml.safe_dump(pretrain))
        print(f"pretraining the base model on {corpus} ({PRETRAIN_EPOCHS} epochs, one process)")
        finetune(resolve_finetune(work / "pretrain.yaml", []))
        target = HERE / "base"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(work / "pretrained" / "merged", target)
    print(f"base model written to {target}")


if __name__ == "__main__":
    main()
