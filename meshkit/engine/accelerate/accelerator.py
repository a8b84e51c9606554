"""`meshkit.Accelerator`: the Engine under Accelerate's name and constructor, so a loop written against
`accelerate.Accelerator` runs by changing only the import:

    from meshkit import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

Accelerate's arguments become code arguments (the highest precedence, as in Accelerate): gradient_accumulation_steps
→ grad_accum_steps, mixed_precision → precision, log_with → logging.trackers, project_dir → logging.dir,
dynamo_backend / dynamo_plugin → compile, cpu → device, kwargs_handlers: InitProcessGroupKwargs(timeout) →
collective_timeout_s, DistributedDataParallelKwargs → ddp.*. Handlers are read by their fields, so Accelerate's
own handler objects work too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from meshkit.core.errors import MeshkitError
from meshkit.engine.engine import Engine


class AcceleratorError(MeshkitError):
    """An Accelerator argument meshkit does not take; the message says what to use."""


@dataclass
class InitProcessGroupKwargs:
    timeout: timedelta | None = None
    backend: str | None = None


@dataclass
class DistributedDataParallelKwargs:
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True


_DDP_FIELDS = (
    "bucket_cap_mb",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "broadcast_buffers",
)
_TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "all": None}


def accelerate_arguments(
    *,
    gradient_accumulation_steps: int | None = None,
    mixed_precision: str | None = None,
    log_with: str | list[str] | None = None,
    project_dir: str | None = None,
    dynamo_backend: str | None = None,
    dynamo_plugin: Any = None,
    kwargs_handlers: list[Any] | None = None,
    cpu: bool = False,
) -> dict[str, Any]:
    """Accelerate's constructor arguments as meshkit code arguments."""
    out: dict[str, Any] = {}
    if gradient_accumulation_steps is not None:
        out["grad_accum_steps"] = gradient_accumulation_steps
    if mixed_precision is not None:
        out["precision"] = str(mixed_precision).lower()
    trackers = [log_with] if isinstance(log_with, str) else list(log_with or [])
    if trackers:
        names = ["jsonl"]
        for tracker in trackers:
            name = str(getattr(tracker, "value", tracker)).lower()
            if name not in _TRACKERS:
                raise AcceleratorError(f"log_with={name!r}: meshkit's trackers are jsonl, tensorboard and wandb")
            names += ["tensorboard", "wandb"] if name == "all" else [name]
        out["logging"] = {"trackers": list(dict.fromkeys(names))}
    if project_dir is not None:
        out.setdefault("logging", {})["dir"] = str(project_dir)
    backend = dynamo_backend or getattr(dynamo_plugin, "backend", None)
    backend_name = str(getattr(backend, "value", backend) or "no").lower()
    if backend_name != "no":
        compile_settings: dict[str, Any] = {"enabled": True, "backend": backend_name}
        for field in ("mode", "fullgraph", "dynamic"):
            value = getattr(dynamo_plugin, field, None)
            if value is not None:
                compile_settings[field] = value
        out["compile"] = compile_settings
    if cpu:
        out["device"] = "cpu"
    for handler in kwargs_handlers or []:
        if hasattr(handler, "static_graph") and hasattr(handler, "find_unused_parameters"):
            out["ddp"] = {field: getattr(handler, field) for field in _DDP_FIELDS if hasattr(handler, field)}
        elif hasattr(handler, "timeout"):
            if handler.timeout is not None:
                out["collective_timeout_s"] = handler.timeout.total_seconds()
        else:
            raise AcceleratorError(
                f"kwargs_handlers: {type(handler).__name__} is not taken (meshkit takes InitProcessGroupKwargs and "
                "DistributedDataParallelKwargs)"
            )
    return out


class Accelerator(Engine):
    """`Engine` built from Accelerate's constructor arguments (see the module docstring); every Engine verb works."""

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        accelerate_names = set(accelerate_arguments.__kwdefaults__ or {})
        translated = accelerate_arguments(**{k: v for k, v in kwargs.items() if k in accelerate_names})
        rest = {k: v for k, v in kwargs.items() if k not in accelerate_names}
        super().__init__(config, **translated, **rest)
