"""Run the `meshkit` command in a subprocess with a hard timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def meshkit(
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess:
    """`meshkit ARGS`; a run that outlives `timeout` raises (the child is killed), so nothing can hang CI."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "meshkit.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or ROOT,
        input=stdin,
    )


def spawn_meshkit(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """`meshkit ARGS` in the background, in its own session, output captured; `prefix` wraps the command (e.g.
    `ip netns exec NS`). The caller stops it (`kill_tree`) and reads it (`communicate`) with a timeout."""
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "meshkit.cli", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc); processes that end meanwhile are skipped."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            found += [int(child), *descendants(int(child))]
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it (torch's agent starts workers in their own sessions)."""
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def kill_all(*procs: subprocess.Popen) -> None:
    """`kill_tree` every process of `procs` still running (the clean-up of a multi-node test)."""
    for proc in procs:
        if proc.poll() is None:
            kill_tree(proc.pid)


def meshkit_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`meshkit ARGS` in this process (typer's test runner): for quick commands that start no process and need no
    clean interpreter (`plan`, `estimate`), two seconds of imports cheaper than `meshkit`."""
    from typer.testing import CliRunner

    from meshkit.cli.main import app

    result = CliRunner().invoke(app, list(args), env=env, prog_name="meshkit")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["meshkit", *args], result.exit_code, result.stdout, result.stderr)
