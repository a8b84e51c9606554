"""Accelerate's ways of saving, on meshkit's checkpoints: `save(obj, f)`, the checkpoint directory a
`save_state()` / `load_state()` without a path picks (ProjectConfiguration's automatic naming and total_limit),
and the state pre-hooks.

`save` writes atomically: a file that is being written never replaces a good one (the bytes go to a temporary
file beside it, renamed once complete).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from meshkit.checkpoint.storage import MANIFEST, UnknownFilesWarning
from meshkit.core.errors import MeshkitError
from meshkit.core.io import follow_umask
from meshkit.runtime.collectives import broadcast_object


class SaveError(MeshkitError):
    """A save the Accelerator cannot make; the message says what to pass instead."""


def save_object(obj: Any, f: Any, safe_serialization: bool) -> None:
    """`obj` to `f` (a path or a file object): safetensors (a dict of tensors) or `torch.save`."""
    if safe_serialization:
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise SaveError("save(safe_serialization=True) takes a dict of tensors; pass safe_serialization=False")
        tensors = {k: v.detach().contiguous() for k, v in obj.items()}
        write = lambda path: save_file(tensors, path, metadata={"format": "pt"})  # noqa: E731
    else:
        write = lambda path: torch.save(obj, path)  # noqa: E731
    if not isinstance(f, (str, os.PathLike)):
        if safe_serialization:
            raise SaveError("save(safe_serialization=True) writes to a path, not a file object")
        torch.save(obj, f)
        return
    target = Path(f)
    handle, temporary = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.", suffix=".partial")
    os.close(handle)
    try:
        write(temporary)
        follow_umask(temporary)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _number(folder: Path) -> int:
    found = re.findall(r"(\d+)(?=[^/]*$)", folder.name)
    return int(found[0]) if found else -1


def automatic_save_dir(project_dir: str | None, iteration: int, total_limit: int | None, is_main: bool) -> Path:
    """`project_dir/checkpoints/checkpoint_<iteration>`; with `total_limit`, the oldest are removed to make room."""
    if project_dir is None:
        raise SaveError("save_state() without a directory needs ProjectConfiguration(project_dir=...) or a path")
    root = Path(project_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    folders = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=_number)
    if total_limit is not None and is_main:
        for old in folders[: max(0, len(folders) + 1 - total_limit)]:
            shutil.rmtree(old)
    target = root / f"checkpoint_{iteration}"
    if target.exists():
        raise SaveError(
            f"{target} already exists: set accelerator.project_configuration.iteration to the next free number"
        )
    return target


def automatic_load_dir(project_dir: str | None) -> Path:
    """The newest `project_dir/checkpoints/checkpoint_<n>`."""
    root = Path(project_dir or ".") / "checkpoints"
    folders = sorted((p for p in root.glob("checkpoint_*") if p.is_dir()), key=_number) if root.is_dir() else []
    if project_dir is None or not folders:
        raise SaveError(f"load_state() without a directory: no checkpoint_<n> under {root}; pass the directory")
    return folders[-1]


def make_room(target: Path) -> Path | None:
    """Accelerate's save_state writes over an earlier state in the same directory. An empty directory is removed;
    an earlier checkpoint is moved aside (returned: removed once the new one is complete); any other directory
    with files in it is refused, so nothing of the user's is lost."""
    if not target.exists():
        return None
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
        return None
    if (target / MANIFEST).is_file():
        aside = target.parent / f".{target.name}.replaced"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
        return aside
    raise SaveError(f"save_state: {target} holds other files (not a checkpoint): choose a new directory")


class StateHooks:
    """Accelerate's `register_save_state_pre_hook` / `register_load_state_pre_hook` registries."""

    def __init__(self) -> None:
        # (OrderedDict: torch's RemovableHandle keeps a weak reference to the registry, which a dict refuses)
        self.save: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self.load: OrderedDict[int, Callable[..., None]] = OrderedDict()

    @staticmethod
    def register(registry: dict[int, Callable[..., None]], hook: Callable[..., None]) -> Any:
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(registry)
        registry[handle.id] = hook
        return handle


def save_state(accelerator: Any, save: Callable[[Path], Path], output_dir: Any, hooks: StateHooks) -> str:
    """Accelerate's save_state over meshkit's (`save`): the directory chosen as Accelerate chooses it, an earlier
    state there replaced atomically, the save hooks run on the complete checkpoint, the iteration counted."""
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        project, iteration, limit = config.project_dir, config.iteration, config.total_limit
        target = main_decides(accelerator, lambda: automatic_save_dir(project, iteration, limit, True))
    elif output_dir is None:
        raise SaveError("save_state() needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
    else:
        target = Path(output_dir)
    aside = main_decides(accelerator, lambda: make_room(target))
    path = save(target)
    if aside is not None and accelerator.is_main_process:
        shutil.rmtree(aside, ignore_errors=True)
    if hooks.save:
        models = list(accelerator.ctx.objects.models)
        weights = [accelerator.get_state_dict(model) for model in models]
        for hook in list(hooks.save.values()):
            hook(models, weights, str(path))
    config.iteration += 1
    return str(path)


def load_state(accelerator: Any, load: Callable[[Path], dict[str, Any]], input_dir: Any, hooks: StateHooks) -> Any:
    """Accelerate's load_state over meshkit's (`load`): the load hooks first; the save hooks' files beside the
    state are expected there (not reported as unknown)."""
    if input_dir is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            raise SaveError("load_state() needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        input_dir = automatic_load_dir(accelerator.project_dir)
    for hook in list(hooks.load.values()):
        hook(list(accelerator.ctx.objects.models), str(input_dir))
    with warnings.catch_warnings():
        if hooks.save:
            warnings.simplefilter("ignore", UnknownFilesWarning)
        extra = load(Path(input_dir))
    accelerator.step = 0
    return extra


def main_decides(accelerator: Any, decide: Callable[[], Any]) -> Any:
    """`decide()` on the main process (it touches the file system); its answer, or its error, on every rank."""
    answer: tuple[bool, Any] = (True, None)
    if accelerator.is_main_process:
        try:
            answer = (True, decide())
        except SaveError as error:
            answer = (False, str(error))
    ok, value = broadcast_object(answer)
    if not ok:
        raise SaveError(value)
    return value
