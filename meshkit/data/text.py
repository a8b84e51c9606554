"""A byte-level tokenizer and fixed-length training windows over a text (the built-in recipe's data)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import Dataset

from meshkit.data.jsonl import DataFormatError

BYTE_VOCAB_SIZE = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, no unknown tokens, vocab size 256."""

    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, tokens: torch.Tensor) -> str:
        return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_text(dataset: str) -> str:
    """'builtin' -> the corpus shipped with meshkit; anything else is a path to a UTF-8 text file."""
    if dataset == "builtin":
        return resources.files("meshkit.data").joinpath("corpus.txt").read_text(encoding="utf-8")
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise DataFormatError(f"train.dataset '{dataset}' is not a file: give a UTF-8 text file or 'builtin'")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataFormatError(f"train.dataset '{dataset}' is not UTF-8 text (byte {err.start}): convert it") from None


class TokenWindows(Dataset):
    """Non-overlapping windows: item i is (tokens[i*L : (i+1)*L], the same shifted by one), each [L]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"the text has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]
