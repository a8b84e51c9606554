"""Two simulated hosts on this machine: two network namespaces joined by a veth pair, each with its own
addresses, so that a job's nodes reach each other only over that link, as across machines.

Needs root and iproute2 (`ip netns`). `/etc/hosts` is shared: this machine's hostname resolves to 127.0.0.1 in
both namespaces, which is the set-up where a node that advertised its hostname would make its peers dial their
own loopback.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys

from tests.helpers.cli import kill_all, spawn_meshkit

SUBNET = "10.213.77"


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why two namespaces cannot be made here, or None (tried once: a container may forbid it even to root)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    probe, link = f"mkprobe{os.getpid()}", f"mkpv{os.getpid() % 100000}"
    tries = (["netns", "add", probe], ["link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b"])
    failed = None
    for args in tries:  # what the tests need: a namespace and a veth pair
        made = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        if made.returncode != 0:
            failed = f"cannot make network namespaces and veth pairs here ({made.stderr.strip()})"
            break
    subprocess.run(["ip", "link", "del", f"{link}a"], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return failed


def covered_on_two_hosts(reason: str = "run on two simulated hosts by tests/multinode"):
    """Skip a single-host stand-in for a multi-node test where the multi-node suite itself runs."""
    import pytest

    return pytest.mark.skipif(unavailable_reason() is None, reason=reason)


class TwoHosts:
    """Host 0 at SUBNET.1, host 1 at SUBNET.2; `start(host, args)` runs `meshkit ARGS` on a host."""

    def __init__(self, tag: str) -> None:
        self.namespaces = (f"mk{tag}a", f"mk{tag}b")
        self.links = (f"mk{tag}va", f"mk{tag}vb")
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.processes: list[subprocess.Popen] = []

    def create(self) -> None:
        self.destroy()  # what a killed earlier run of the same test may have left
        for ns in self.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for ns, link, address in zip(self.namespaces, self.links, self.addresses, strict=True):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def destroy(self) -> None:
        kill_all(*self.processes)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
        for ns in self.namespaces:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def start(self, host: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`meshkit ARGS` inside host `host`'s namespace, in its own session (killed with its tree at the end)."""
        proc = spawn_meshkit(*args, env=env, prefix=("ip", "netns", "exec", self.namespaces[host]))
        self.processes.append(proc)
        return proc

    def unplug(self, host: int) -> None:
        """Take host `host` off the link without a word: its peers see silence, not a closed connection."""
        _ip("-n", self.namespaces[host], "link", "set", self.links[host], "down")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def output_of(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """Wait for `proc` (a hang fails the test: it raises after `timeout`), then its exit code and output."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err
