"""The sequence a block sees, read from the first forward rather than from the config: under sequence parallel the
norms between tensor-parallel regions run on this rank's shard of the sequence, under context parallel every block
runs on this rank's chunks. A one-shot hook on the model and one on its first block record the tokens per row the
model was called with and the tokens per row the block got, for the run's record (and a notice where sequence
parallel was asked for and the block saw the whole sequence)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshkit.models.blocks import BlockError, block_units, find_blocks
from meshkit.runtime.dtensors import local_tensor


@dataclass
class SequenceSeen:
    """Tokens per row of the first forward: the model's input (`called`: under cp already this rank's chunks) and
    the first block's (`block`); `cp` and `tp_shards` (tp under sequence parallel, else 1): the split asked for."""

    cp: int
    tp_shards: int
    called: int | None = None
    block: int | None = None

    def words(self) -> str | None:
        """`8 of 32 tokens per row (asked: 1/4)`, and where the split asked for is not what the block got, so;
        None before a forward."""
        if self.called is None or self.block is None:
            return None
        whole, parts = self.called * self.cp, self.cp * self.tp_shards
        words = f"{self.block} of {whole} tokens per row in the blocks"
        if parts > 1 and self.block * parts != whole:
            words += f" (NOT the 1/{parts} asked for: cp={self.cp}, sequence-parallel shards={self.tp_shards})"
        return words


def watch_sequence(model: nn.Module, blocks_path: str | None, cp: int, tp_shards: int) -> SequenceSeen | None:
    """Hooks that record, once, the sequence the model and its first block see (None: no blocks to watch)."""
    try:
        _, container = find_blocks(model, blocks_path)
    except BlockError:
        return None
    first = next(block_units(container), None)
    if first is None:
        return None
    seen = SequenceSeen(cp, tp_shards)

    def on_model(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if seen.called is None and isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            seen.called = int(ids.shape[1])
            model_hook.remove()

    def on_block(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if seen.block is None and isinstance(hidden, torch.Tensor) and hidden.dim() >= 3:
            seen.block = int(local_tensor(hidden).shape[1])  # [batch, seq, ...] (hyper-connections: streams after)
            block_hook.remove()

    model_hook = model.register_forward_pre_hook(on_model, with_kwargs=True)
    block_hook = first[1].register_forward_pre_hook(on_block, with_kwargs=True)
    return seen
