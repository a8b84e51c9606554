"""Checks the launcher makes before any worker starts: an error known from the config alone is one line from
the launcher (exit code 2), not a traceback from every rank."""

from __future__ import annotations

from pathlib import Path

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


def check_recipe(config: RunConfig) -> None:
    """For `meshkit train`: the whole job is known, the model's head counts included."""
    import torch

    from meshkit.models.gpt import GPT
    from meshkit.parallel.tensor.apply import check_heads

    layouts = check_layout(config)
    tp = max(dims.tp for dims in layouts)
    if tp > 1:
        with torch.device("meta"):
            model = GPT(config.model)
        check_heads(model, tp)
    check_resume_path(config)
