"""`find_executable_batch_size`: run a training function at the largest batch size that fits, as Accelerate's
decorator of that name does (the batch size shrinks by 10 % after each out-of-memory error)."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch

_OUT_OF_MEMORY = (
    " out of memory.",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
)


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorator: `function(batch_size, *args)` is called with `starting_batch_size`, then with 90 % of it (or
    what `reduce_batch_size_fn()` returns) after each out-of-memory error, until it returns; callers leave the
    batch size out (`train(model, optimizer)`)."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def smaller() -> int:
        return reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch_size * 0.9)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        while True:
            if batch_size <= 0:
                raise RuntimeError(f"{function.__name__}: no batch size fits in memory (reached 0)")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = smaller()

    return run
