"""Shared pieces of the fault-injection suite: start a launcher in the background, wait for files, read the
state of processes and the sockets they listen on (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.cli import kill_tree, spawn_meshkit

needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads process state from /proc")


@contextlib.contextmanager
def background_meshkit(*args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`meshkit ARGS` in its own process group; killed with everything below it when the block ends."""
    proc = spawn_meshkit(*args, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def running(pid: int) -> bool:
    """Alive and not a zombie (a dead child nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def listening_addresses(pids: list[int]) -> list[str]:
    """'ip:port' of every TCP socket these processes listen on (IPv4 and IPv6)."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(_address(fields[1], width))
    return found


def _address(hex_address: str, width: int) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if width == 8:
        ip = ".".join(str(b) for b in raw[::-1])
    else:  # four little-endian 32-bit words
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        ip = ":".join(b"".join(words).hex()[i : i + 4] for i in range(0, 32, 4))
    return f"{ip}:{int(port, 16)}"


def is_loopback(address: str) -> bool:
    ip = address.rsplit(":", 1)[0]
    return ip.startswith("127.") or ip == "0000:0000:0000:0000:0000:0000:0000:0001" or ip.endswith("ffff:7f00:0001")


def stop(proc: subprocess.Popen, how: int = signal.SIGKILL, group: bool = False) -> None:
    if group:
        os.killpg(proc.pid, how)
    else:
        os.kill(proc.pid, how)
