"""Checks the launcher makes before any worker starts: an error known from the config alone is one line from
the launcher (exit code 2), not a traceback from every rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meshkit.config.idle import UNCHOSEN as _NOT_SET
from meshkit.config.layout import Layout
from meshkit.config.schema import RunConfig
from meshkit.core.errors import MeshkitError


class PreflightError(MeshkitError):
    """The configured job cannot run on this world; the message says what to change."""


def worlds(config: RunConfig) -> list[tuple[int, str]]:
    """(world size, how it comes about) for the node counts the job may run with."""
    launch = config.launch
    if launch.backend == "ray":
        return [(launch.world_size, f"{launch.world_size} Ray worker(s)")]
    counts = sorted({launch.min_nnodes or launch.nnodes, launch.nnodes}, reverse=True)
    return [(n * launch.nproc_per_node, f"{n} node(s) × {launch.nproc_per_node} process(es)") for n in counts]


def check_layout(config: RunConfig) -> list[Layout]:
    """The layout at every world size the job may have (elastic: its largest and smallest)."""
    found = []
    for world, how in worlds(config):
        try:
            found.append(Layout.from_config(config.parallel, world))
        except MeshkitError as err:
            raise PreflightError(f"{err} ({how})") from None
    return found


def check_resume_path(config: RunConfig) -> None:
    resume = config.checkpoint.resume
    if resume not in ("never", "auto") and not Path(resume).exists():
        raise PreflightError(
            f"checkpoint.resume={resume}: no such checkpoint directory (use auto for the newest under "
            "checkpoint.dir, or never)"
        )


def check_job(config: RunConfig, sources: dict[str, str]) -> None:
    """For `meshkit launch SCRIPT`: what the config alone decides (the script's code may add more)."""
    if any(sources.get(key, "default") not in _NOT_SET for key in sources if key.startswith("parallel.")):
        check_layout(config)
    check_resume_path(config)


def splits_the_model(config: RunConfig) -> bool:
    """Does any layout the job may have split the model itself (tp, pp or ep), so that it must fit the model?"""
    return any(dims.tp > 1 or dims.pp > 1 or dims.ep > 1 for dims in check_layout(config))


def check_model(model: Any, config: RunConfig) -> None:
    """Every layout the job may have against the model (built on the meta device: no memory, no weights): head
    counts, blocks and experts, through the same checks `parallelize` makes, sizes offered fitting the world."""
    from meshkit.models.structure import describe
    from meshkit.parallel.layout_fit import check_layout_fits

    structure = describe(model, config.blocks, config.structure)
    for dims, (_, how) in zip(check_layout(config), worlds(config), strict=True):
        try:
            check_layout_fits(model, structure, dims, config)
        except MeshkitError as err:
            raise PreflightError(f"{err} ({how})") from None


def check_writable(path: Path, key: str) -> None:
    """`path` (made if missing) can be written here: its nearest existing ancestor is a writable directory."""
    existing = path.expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PreflightError(f"{key}={path}: {existing} is not a directory this user can write: choose another")


def check_outputs(config: RunConfig) -> None:
    """Where the run writes: its run directory, and its checkpoints where a save may happen."""
    check_writable(config.logging.dir, "logging.dir")
    if config.checkpoint.dir is not None:
        check_writable(config.checkpoint.dir, "checkpoint.dir")


def check_recipe(config: RunConfig) -> None:
    """For `meshkit train`: the whole job is known, the model and the data included."""
    import torch

    from meshkit.models.gpt import GPT

    dataset = config.train.dataset
    if dataset != "builtin" and not Path(dataset).expanduser().is_file():
        raise PreflightError(
            f"train.dataset={dataset}: no such file (give a UTF-8 text file, or builtin for the shipped corpus)"
        )
    check_outputs(config)
    if splits_the_model(config):
        with torch.device("meta"):
            check_model(GPT(config.model), config)
    check_resume_path(config)
