"""`accelerator.profile()`: torch.profiler set by Accelerate's ProfileKwargs fields, a Chrome trace per process."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

_ACTIVITIES = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
_OPTIONS = ("record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules")


@contextlib.contextmanager
def profiled(handler: Any, process_index: int, wait_for_everyone: Callable[[], None]) -> Iterator[Any]:
    """The profiler around the block; with `output_trace_dir`, `profile_<process_index>.json` is written there
    and the processes meet once every trace is out."""
    activities = None
    if handler is not None and getattr(handler, "activities", None) is not None:
        activities = [_ACTIVITIES[str(getattr(kind, "value", kind)).lower()] for kind in handler.activities]
    options: dict[str, Any] = {name: getattr(handler, name, False) for name in _OPTIONS}
    schedule_option = getattr(handler, "schedule_option", None)
    schedule = torch.profiler.schedule(**schedule_option) if schedule_option else None
    on_trace_ready = getattr(handler, "on_trace_ready", None)
    with torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=on_trace_ready, **options
    ) as profiler:
        yield profiler
    out_dir = getattr(handler, "output_trace_dir", None)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(Path(out_dir) / f"profile_{process_index}.json"))
        wait_for_everyone()
