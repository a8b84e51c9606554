"""Keep torch's C++ connection-retry traces off the user's terminal; they go to the launcher's log file.

When a store is unreachable, torch's C++ client logs each retry with a 60-line native stack (`frame #0:
c10::Error::Error ...`). The launcher routes its stderr (inherited by the workers) through a pipe, or a
pseudo-terminal when stderr is a terminal: lines from torch's c10d C++ logging and the native stacks that
follow them are written to the log file (created on the first such line) instead of the terminal. Python
tracebacks, progress bars and everything else pass through unchanged.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_CPP_LOG = re.compile(rb"^\[[WEIF]\d{4} [\d:.]+ [\w.]+:\d+\] ")  # glog-style: [W1123 20:18:15.916 socket.cpp:1028]
_NATIVE_STACK = (b"Exception raised from ", b"frame #", b"<omitting python frames>")
# torch's agent narrating a stop the launcher began and says in its own line (a preemption, Ctrl-C, a failure)
_AGENT_STOPPING = re.compile(
    rb"^[WI]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/\S+\] "
    rb"(Received \d+ death signal, shutting down workers|Sending process \d+ closing signal \w+)"
)
# Third-party lines that tell the user nothing, by the logger that writes them and how they start: bitsandbytes
# looks for an optional CPU kernel at import (every rank, every fine-tune) and works without it.
THIRD_PARTY_NOISE = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community"}
_THIRD_PARTY = tuple(start.encode() for start in THIRD_PARTY_NOISE.values())


def is_noise(line: bytes, in_stack: bool) -> tuple[bool, bool]:
    """(drop this line, a native stack continues after it)."""
    if (_CPP_LOG.match(line) and b"[c10d]" in line) or line.startswith(_THIRD_PARTY) or _AGENT_STOPPING.match(line):
        return True, False
    if line.startswith(_NATIVE_STACK):
        return True, True
    if in_stack and not line.strip():
        return True, False  # the blank line that ends a native stack
    return False, False


@contextlib.contextmanager
def filtered_stderr(log_path: Path | None) -> Iterator[Path | None]:
    """Route fd 2 of this process (and of the children it starts) through the filter for the block."""
    if log_path is None or not hasattr(os, "pipe"):
        yield None
        return
    log = _LazyLog(log_path)
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = _channel(terminal)
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end, terminal, log), name="meshkit-stderr", daemon=True)
    pump.start()
    try:
        yield log_path
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # our end of the pipe is closed; the pump ends once no child holds it either
        pump.join(timeout=5)
        os.close(terminal)
        log.close()


def _channel(terminal: int) -> tuple[int, int]:
    """A pipe; or, when stderr is a terminal, a pseudo-terminal of the same size, so that progress bars and
    colours (which check isatty) still render live."""
    if not os.isatty(terminal):
        return os.pipe()
    try:
        import fcntl
        import termios

        read_end, write_end = os.openpty()
        size = fcntl.ioctl(terminal, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(write_end, termios.TIOCSWINSZ, size)
        attrs = termios.tcgetattr(write_end)
        attrs[1] &= ~termios.OPOST  # pass bytes through as written (no \n -> \r\n)
        termios.tcsetattr(write_end, termios.TCSANOW, attrs)
        return read_end, write_end
    except (ImportError, OSError):
        return os.pipe()


_MAYBE_NOISE = (b"[", b"W1", b"I1", b"W0", b"I0", b"Exception raised", b"frame #", b"<omitting", *_THIRD_PARTY)


def _pump(read_end: int, terminal: int, log: _LazyLog) -> None:
    in_stack = False
    with os.fdopen(read_end, "rb", buffering=0) as source:
        pending = b""
        while chunk := _read(source):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            out = []
            for raw in lines:
                line = raw + b"\n"
                drop, in_stack = is_noise(line, in_stack)
                if drop:
                    log.write(line)
                else:
                    out.append(line)
            if pending and not any(p.startswith(pending[: len(p)]) or pending.startswith(p) for p in _MAYBE_NOISE):
                out.append(pending)  # a partial line that cannot be noise (e.g. a progress bar's \r update)
                pending = b""
            log.flush()
            if out:
                _write_all(terminal, b"".join(out))
        if pending:
            _write_all(terminal, pending)


class _LazyLog:
    """The log file, opened (for appending) only when there is something to keep."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None
        self._unwritable = False  # the noise is dropped

    def write(self, data: bytes) -> None:
        if self._file is None and not self._unwritable:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("ab")
            except OSError:
                self._unwritable = True
        if self._file is not None:
            self._file.write(data)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _read(source: io.RawIOBase) -> bytes:
    try:
        return source.read(65536) or b""
    except OSError:  # a pseudo-terminal whose last writer closed reads as EIO
        return b""


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]


class _ThirdPartyNoise(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def quiet_third_party_loggers() -> None:
    """In a process that trains without the launcher (a world of one), drop the same third-party lines at their
    loggers. Idempotent; for the command line's own process, never called by the library."""
    for name, start in THIRD_PARTY_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ThirdPartyNoise) for f in logger.filters):
            logger.addFilter(_ThirdPartyNoise(start))
