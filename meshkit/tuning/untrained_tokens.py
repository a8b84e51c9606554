"""`fix_untrained_tokens` (Axolotl's key): tokens the training data uses whose rows were never trained — every value
at most 1e-16 in both the input embedding and the output head, as reserved tokens are often released (Llama 3's
`<|reserved_special_token_*|>`) — start at the mean of the trained rows, scaled by how often the data uses the
token against its most used one; a zero row would give their first steps exploding logits. A list of token ids
names tokens to treat so whatever their rows hold (Axolotl's `token_ids_to_fix`).

The new rows are computed once from the checkpoint's own tensors, the same on every rank (no collective), and
written into each rank's piece of the embedding and of the head once they are placed (a sharded tensor is gathered
and written back, one at a time), so every layout starts from the same weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.models.adapters import base_checkpoint_name
from meshkit.models.structure import describe
from meshkit.parallel.materialize import safetensors_files, set_local

UNTRAINED_AT_MOST = 1e-16


@dataclass(frozen=True)
class RowFix:
    ids: list[int]  # the tokens whose rows start anew
    rows: dict[str, torch.Tensor]  # checkpoint tensor name -> their new rows, [len(ids), hidden] float32


def token_counts(samples: Iterable[Sequence[int]], size: int) -> np.ndarray:
    """How often each of `size` token ids occurs in `samples` (token id sequences)."""
    counts = np.zeros(size, dtype=np.int64)
    for ids in samples:
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=size)[:size]
    return counts


def plan_fix(source: Path, names: Sequence[str], counts: np.ndarray, requested: Sequence[int] = ()) -> RowFix | None:
    """The rows to write for the tensors `names` of the checkpoint `source` (its embedding and head: one name
    when they are tied), or None when no token the data uses has untrained rows and none was `requested`."""
    files = safetensors_files(source)
    tensors = {}
    for name in dict.fromkeys(name for name in names if name in files):  # (a tied head is stored once)
        with safe_open(str(files[name]), framework="pt") as handle:
            tensors[name] = handle.get_tensor(name).float()
    rows = min(tensor.shape[0] for tensor in tensors.values())
    untrained = torch.ones(rows, dtype=torch.bool)
    for tensor in tensors.values():
        untrained &= tensor[:rows].amax(dim=1) <= UNTRAINED_AT_MOST
    used = torch.from_numpy(counts[:rows] > 0)
    chosen = untrained & used
    for token in requested:
        if 0 <= token < rows:
            chosen[token] = True
    ids = torch.nonzero(chosen).flatten()
    if ids.numel() == 0:
        return None
    trained = ~(untrained | chosen)
    scale = torch.from_numpy(counts[ids.numpy()] / max(int(counts.max()), 1)).float().unsqueeze(1)
    new_rows = {}
    for name, tensor in tensors.items():
        mean = tensor[:rows][trained].sum(dim=0) / max(int(trained.sum()), 1)
        new_rows[name] = mean.unsqueeze(0) * scale
    return RowFix(ids.tolist(), new_rows)


@torch.no_grad()
def apply_fix(model: nn.Module, vocabulary: Sequence[str], fix: RowFix) -> int:
    """Write the new rows into this rank's pieces of the model's `vocabulary` parameters (those this rank holds);
    returns how many parameters it wrote."""
    written = 0
    ids = torch.tensor(fix.ids)
    for name, param in model.named_parameters():
        stored = base_checkpoint_name(name)
        if stored not in vocabulary or stored not in fix.rows:
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
        full[ids] = fix.rows[stored].to(full.dtype)
        set_local(param, full)
        written += 1
    return written


def fix_untrained_tokens(
    model: nn.Module, setting: bool | int | list[int], source: Path, token_ids: Iterable[Sequence[int]]
) -> str:
    """Apply `fix_untrained_tokens` to the placed `model` (checkpoint `source`, the token ids of every training row);
    returns the line that says what it did."""
    vocabulary = describe(model).vocabulary
    names = [base_checkpoint_name(name) for name in vocabulary]
    rows = next((p.shape[0] for name, p in model.named_parameters() if name in vocabulary), None)
    if rows is None:  # a pipeline stage between the first and the last holds neither the embedding nor the head
        return "fix_untrained_tokens: this pipeline stage holds no token rows"
    counts = token_counts(token_ids, rows)
    fix = plan_fix(source, names, counts, setting if isinstance(setting, list) else ())
    if fix is None:
        return "fix_untrained_tokens: no token of the training data has untrained rows"
    apply_fix(model, names, fix)
    shown = ", ".join(map(str, fix.ids[:8])) + (", ..." if len(fix.ids) > 8 else "")
    return (f"fix_untrained_tokens: {len(fix.ids)} token(s) start at the mean of the trained rows, scaled by their "
            f"frequency (ids {shown})")  # fmt: skip
