"""Make the tiny base model the fine-tuning examples start from, offline: a BPE tokenizer trained on the
example data and a randomly initialised Llama-style model, in `save_pretrained` layout.

    python examples/finetune/make_base_model.py            # writes examples/finetune/base/
"""

from pathlib import Path

from meshkit.recipes.tiny_model import make_tiny_base_model, texts_of_jsonl

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    data = [HERE / "alpaca.jsonl", HERE / "chat.jsonl"]
    out = make_tiny_base_model(HERE / "base", texts_of_jsonl(data), vocab_size=512, hidden_size=64, layers=4)
    print(f"base model written to {out}")
