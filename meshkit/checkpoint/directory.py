"""A checkpoint root: `step-000100/` directories, the `latest` pointer, pruning and choosing what to resume.

A save goes to `.step-000100.partial/` and becomes `step-000100/` by one rename once every file is written,
fsynced and listed in the manifest; only then does `latest` move (itself replaced atomically). A crash at
any point leaves the previous checkpoint complete and still `latest`. A committed directory is only ever
deleted by `keep_last`; one that a new save of the same step would replace is kept under another name.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

from meshkit.checkpoint.storage import CheckpointError, fsync_dir, verify

LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointSkippedWarning(UserWarning):
    """A checkpoint failed its integrity check and an older one is used instead."""


class CheckpointReplacedWarning(UserWarning):
    """A committed checkpoint of the step being saved existed; it was renamed, not deleted."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".{step_dir_name(step)}.partial"


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every committed checkpoint under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def commit(partial: Path, root: Path, step: int, keep_last: int) -> Path:
    """Rename a fully written checkpoint into place, point `latest` at it, drop the oldest beyond keep_last."""
    final = root / step_dir_name(step)
    if final.exists():  # the same step saved again (e.g. after resuming from an older one): keep the old
        kept = _free_name(root, f"{final.name}.replaced")
        os.replace(final, kept)
        warnings.warn(
            f"{final} already existed (a newer checkpoint that could not be resumed, or another run's): "
            f"kept as {kept.name}; delete it when it is no longer needed",
            CheckpointReplacedWarning,
            stacklevel=2,
        )
    os.replace(partial, final)
    fsync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    with pointer.open("w") as handle:
        handle.write(final.name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(pointer, root / LATEST)
    fsync_dir(root)
    for _, old in committed_steps(root)[keep_last:]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _free_name(root: Path, base: str) -> Path:
    candidate, n = root / base, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{base}-{n}"
    return candidate


def remove_partials(root: Path) -> None:
    """Leftovers of saves that never committed (a crash mid-save)."""
    if root.is_dir():
        for path in root.glob(".step-*.partial"):
            shutil.rmtree(path, ignore_errors=True)


def latest(root: Path) -> Path | None:
    """The newest checkpoint under `root` that passes its integrity check; a failing one is skipped loudly.

    None when `root` holds no checkpoint at all. When it holds some and none passes, CheckpointError names
    each and why: starting over from step 0 would silently discard the training they hold.
    """
    candidates = committed_steps(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        candidates.sort(key=lambda item: item[1] != named)  # the pointed-to one first, then newest first
    problems = []
    for _, directory in candidates:
        try:
            verify(directory)
        except CheckpointError as err:
            problems.append(f"{directory.name}: {str(err).removeprefix(f'checkpoint {directory}: ')}")
            warnings.warn(f"skipping {err}; trying the previous checkpoint", CheckpointSkippedWarning, stacklevel=2)
            continue
        return directory
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise CheckpointError(
            f"none of the {len(problems)} checkpoints under {root} can be used ({shown}): repair or move them, "
            "or set checkpoint.resume=never to start over"
        )
    return None


def resolve_resume(resume: str, root: Path, label: str = "checkpoint.resume") -> Path | None:
    """`never` -> None; `auto` -> the newest good checkpoint under root (None when there is none); else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(root)
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"{label}={resume}: no such checkpoint directory")
    if (path / LATEST).is_file() or (not (path / "manifest.json").exists() and committed_steps(path)):
        found = latest(path)  # a checkpoint root was given: take its newest good checkpoint
        if found is None:
            raise CheckpointError(f"{label}={resume}: no complete checkpoint in this directory")
        return found
    verify(path)
    return path
