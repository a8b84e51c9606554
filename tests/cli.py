"""Run the `meshkit` command in a subprocess with a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
