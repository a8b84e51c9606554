"""Seeding of every random generator a training run touches."""

from __future__ import annotations

import random

import torch


def set_seed(seed: int, *, rank: int | None = None) -> int:
    """Seed Python, NumPy (when installed) and torch on every device; returns the seed used.

    With `rank`, each process gets `seed + rank` (different dropout masks or data augmentation per rank);
    without it every rank draws the same numbers, which keeps model initialisation identical.
    """
    value = seed + (rank or 0)
    random.seed(value)
    torch.manual_seed(value)  # also seeds every CUDA device
    try:
        import numpy
    except ImportError:
        return value
    numpy.random.seed(value % 2**32)
    return value
