"""Whether a checkpoint fits the model it loads into: the errors that say it does not, and the key check."""

from __future__ import annotations

from collections.abc import Callable

import torch

StoredShapes = dict[str, tuple[torch.Size, torch.dtype]]


class CheckpointMismatchError(ValueError):
    """The checkpoint belongs to another model."""


class CheckpointLayoutError(CheckpointMismatchError):
    """The checkpoint's optimizer states are in a form this run's layout cannot read."""


def raise_mismatch(what: str, expected: str) -> None:
    raise CheckpointMismatchError(f"checkpoint does not match this model: {what}, {expected}")


def check_keys(
    live: dict[str, torch.Tensor],
    stored: StoredShapes,
    everywhere: set[str] | None = None,
    any_length: Callable[[str], bool] = lambda _key: False,
) -> None:
    """The model's tensors must all be in the checkpoint with the same shapes (but those `any_length` names), and
    the checkpoint must hold no model tensor this model lacks (`everywhere`: the names held by any pipeline
    stage); names the first mismatches."""
    problems = []
    for key, tensor in live.items():
        if key not in stored:
            problems.append(f"{key} missing")
        elif tuple(stored[key][0]) != tuple(tensor.shape) and not any_length(key):
            problems.append(f"{key} {tuple(stored[key][0])} in the checkpoint vs {tuple(tensor.shape)} here")
    known = live.keys() if everywhere is None else everywhere
    extra = sorted(k for k in stored if k.startswith("model") and k not in known)
    problems += [f"{key} not in this model" for key in extra]
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise CheckpointMismatchError(f"checkpoint does not match this model: {shown}")
