"""One rank on a Ray cluster: the actor that runs meshkit's worker bootstrap as its child process.

The driver (`ray_backend.py`) places one `RankHost` actor per rank in a placement group. Each actor says where
it landed (node, address, GPUs, a free port), then starts `python -m meshkit.launching.worker PROGRAM ARGS`
with the environment meshkit's own launcher gives its workers, and relays the child's output and its exit to
the driver. The child is the same process `meshkit launch` would start: the script runs as `__main__` in its
main thread, errors go to the elastic error file, a peer's loss is one line; it dies with its actor.

Plain Python (no `ray` import here): the driver wraps the class with `ray.remote`.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from meshkit.launching.interfaces import GLOO_INTERFACE_ENV, gloo_interface, quiet_port
from meshkit.launching.worker import ERROR_FILE_ENV, LAUNCHER_PID_ENV


@dataclass(frozen=True)
class Placement:
    """Where Ray put an actor."""

    node_id: str
    address: str
    gpu_ids: tuple[str, ...]
    port: int  # free on that node when asked: rank 0's hosts the job's store


@dataclass(frozen=True)
class Progress:
    """What the child wrote since the last look, and its exit once it has one."""

    stdout: bytes
    stderr: bytes
    exitcode: int | None  # negative: killed by that signal
    exited_at: float | None  # wall-clock time, as the actor saw it
    error_record: str | None  # the elastic error file's text, when the child wrote one
    pid: int


class RankHost:
    """A Ray actor's body: `place()`, then `start()`, then `progress()` until it reports an exit."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self._lock = threading.Lock()
        self._exited_at: float | None = None
        self._relays: list[threading.Thread] = []
        self._error_file = Path(tempfile.mkdtemp(prefix="meshkit-ray-rank-")) / "error.json"

    def place(self) -> Placement:
        import ray

        address = ray.util.get_node_ip_address()
        gpus = tuple(str(gpu) for gpu in ray.get_gpu_ids())
        return Placement(ray.get_runtime_context().get_node_id(), address, gpus, quiet_port(address))

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None, advertise: str) -> int:
        """Start the rank's worker; its connections use the interface holding `advertise`. Returns its pid."""
        environ = {**os.environ, **env, ERROR_FILE_ENV: str(self._error_file), LAUNCHER_PID_ENV: str(os.getpid())}
        interface = gloo_interface(advertise, environ)
        if interface is not None:
            environ[GLOO_INTERFACE_ENV] = interface
        self._child = subprocess.Popen(
            [sys.executable, *argv],
            env=environ,
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, stream in (("stdout", self._child.stdout), ("stderr", self._child.stderr)):
            relay = threading.Thread(target=self._relay, args=(name, stream), daemon=True)
            relay.start()
            self._relays.append(relay)
        threading.Thread(target=self._wait, daemon=True).start()
        return self._child.pid

    def _relay(self, name: str, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        buffered = cast(io.BufferedReader, stream)  # (a pipe opened in binary mode: it reads what is there)
        for chunk in iter(lambda: buffered.read1(65536), b""):
            with self._lock:
                self._chunks[name].append(chunk)

    def _wait(self) -> None:
        assert self._child is not None
        self._child.wait()
        self._exited_at = time.time()

    def progress(self) -> Progress:
        child = self._child
        exitcode = None if child is None or self._exited_at is None else child.returncode
        if exitcode is not None:
            for relay in self._relays:  # the child's last output, read after its exit
                relay.join(timeout=2.0)
        with self._lock:
            out, err = b"".join(self._chunks["stdout"]), b"".join(self._chunks["stderr"])
            self._chunks = {"stdout": [], "stderr": []}
        record = None
        if exitcode is not None and self._error_file.is_file():
            with contextlib.suppress(OSError):
                record = self._error_file.read_text()
        return Progress(out, err, exitcode, self._exited_at, record, child.pid if child is not None else -1)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Signal the child (the driver stops the others after a rank failed)."""
        if self._child is not None and self._child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._child.send_signal(signum)

    def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "child": self._child.pid if self._child is not None else None}
