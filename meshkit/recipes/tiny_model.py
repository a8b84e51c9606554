"""A tiny Llama-style base model directory, made offline: a byte-level BPE tokenizer trained on given texts
(`tokenizers`) with a ChatML chat template, and a randomly initialised `LlamaForCausalLM`, both written in
`save_pretrained` layout. It stands in for a downloaded checkpoint in the fine-tuning example and the tests. A tiny
Mistral tokenizer file (`tekken.json`) stands in for Mistral's own (`write_tiny_tekken`).

    python -m meshkit.recipes.tiny_model OUT_DIR FILE.jsonl [FILE.jsonl ...]
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from meshkit.data.formats import ALPACA_NO_INPUT, ALPACA_WITH_INPUT

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def texts_of_jsonl(paths: Iterable[str | Path]) -> Iterator[str]:
    """Every string value in the records (instructions, outputs, message contents), for tokenizer training."""

    def strings(value: Any) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for item in value.values():
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)

    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield from strings(json.loads(line))


def make_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (`tokenizers`) wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(texts), trainer=trainer)
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def make_tiny_base_model(
    out_dir: str | Path,
    texts: Iterable[str],
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 256,
    seed: int = 0,
) -> Path:
    """Write tokenizer files, config.json, generation_config.json and model.safetensors into `out_dir`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    # The instruction templates' words too, as a tokenizer trained on real text would know them.
    tokenizer = make_tokenizer([*texts, *[ALPACA_WITH_INPUT, ALPACA_NO_INPUT] * 20], vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# tiktoken's pattern of the tekken files Mistral publishes (words, numbers, punctuation, spaces)
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
TEKKEN_SPECIAL_TOKENS = 20


def write_tiny_tekken(directory: Path, thinking: bool = False) -> int:
    """A tiny Mistral tokenizer file, `directory`/tekken.json (for `tokenizer_use_mistral_common`): the 256 bytes as
    its vocabulary and the first special tokens of mistral-common's default list (`<unk>`, `<s>`, `</s>`, `[INST]`,
    `[/INST]`, ...); with `thinking`, a v13 tokenizer with `[THINK]`/`[/THINK]` (and v13's `[ARGS]`, `[CALL_ID]`),
    which encodes Magistral's thinking chunks; returns its vocabulary size."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None} for i in range(256)]
    specials = [
        dict(token, token_str=str(getattr(token["token_str"], "value", token["token_str"])))
        for token in Tekkenizer.DEPRECATED_SPECIAL_TOKENS[:TEKKEN_SPECIAL_TOKENS]
    ]  # fmt: skip (enum members -> text)
    if thinking:
        specials += [{"rank": len(specials) + i, "token_str": text, "is_control": True}
                     for i, text in enumerate(("[THINK]", "[/THINK]", "[ARGS]", "[CALL_ID]"))]  # fmt: skip
    size = len(vocab) + len(specials)
    config = {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": len(vocab), "default_vocab_size": size,
              "default_num_special_tokens": len(specials), "version": "v13" if thinking else "v7"}  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tekken.json").write_text(json.dumps({"config": config, "vocab": vocab, "special_tokens": specials}))
    return size


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit("usage: python -m meshkit.recipes.tiny_model OUT_DIR FILE.jsonl [FILE.jsonl ...]")
    out = make_tiny_base_model(argv[0], texts_of_jsonl(argv[1:]))
    print(f"tiny base model written to {out}")


if __name__ == "__main__":
    main()
