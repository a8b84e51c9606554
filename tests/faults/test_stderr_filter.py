"""torch's C++ retry traces leave the terminal and land in the launcher's log; everything else passes."""

from __future__ import annotations

import subprocess
import sys

NOISE_AND_OUTPUT = r"""
import os, subprocess, sys
from pathlib import Path
from meshkit.launching.stderr_filter import filtered_stderr

with filtered_stderr(Path(sys.argv[1])):
    subprocess.run(["sh", "-c", "printf '%s\n' \
        '[W1123 20:18:15.916626290 TCPStore.cpp:340] [c10d] TCP client failed to connect - retrying' \
        'Exception raised from throwTimeoutError at socket.cpp:1030 (most recent call first):' \
        'frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d' \
        'frame #1: <unknown function> + 0x163b752' \
        '' \
        'Failed to load CPU gemm_4bit_forward from kernels-community: No module named kernels.' \
        'Traceback (most recent call last):' \
        'ValueError: a real error' >&2"])
    os.write(2, b"progress 3/10\r")
"""


def test_native_retry_traces_go_to_the_log_and_the_rest_to_the_terminal(tmp_path) -> None:
    log = tmp_path / "run" / "launch-node0.log"
    proc = subprocess.run([sys.executable, "-c", NOISE_AND_OUTPUT, str(log)], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b"Traceback (most recent call last):\nValueError: a real error\nprogress 3/10\r"
    kept = log.read_text()
    assert "[c10d] TCP client failed to connect" in kept and "frame #1:" in kept and "ValueError" not in kept
    assert "gemm_4bit_forward" in kept  # a third-party line that tells the user nothing: kept in the log only
