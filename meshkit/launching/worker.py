"""Worker bootstrap (`python -m meshkit.launching.worker [-m] PROGRAM ARGS...`), started by `meshkit launch`.

Before the user's script or module runs (as `__main__`), the worker
- ties its life to the launcher's: the kernel SIGKILLs it when the launcher dies (Linux parent-death signal),
  and a watchdog thread does the same where that is unavailable or the launcher died before it was set;
- on global rank 0, hosts this attempt's store on the address the launcher chose (never every interface).
An exception is written, with its traceback, to the error file the elastic agent hands each worker, so the
launcher can say which rank failed and why; a meshkit input error (a bad setting) is one line, exit code 2. A rank
that failed only because a peer is gone (gloo's "Connection closed by peer", NCCL's "remote process exited")
prints one line and leaves its traceback in the launcher's log file: the terminal shows the cause, not its echoes.
A failed worker leaves without interpreter teardown: the native threads of a process group still alive can
crash it (SIGSEGV), and the launcher would report that signal instead of the error's exit status.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing.errors import record

from meshkit.core.errors import MeshkitError
from meshkit.launching.stores import host_worker_store
from meshkit.launching.supervisor import FAILED_PREFIX
from meshkit.runtime.preemption import INTERRUPTED_EXIT_CODE, LAUNCHER_STATE_ENV, PREEMPTED_EXIT_CODE

LAUNCHER_PID_ENV = "MESHKIT_LAUNCHER_PID"
LAUNCH_LOG_ENV = "MESHKIT_LAUNCHER_LOG"  # the launcher's log file for this node (not a config key)
# How the backends say that the other end of a connection is gone (the error is then a consequence).
PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)
_PR_SET_PDEATHSIG = 1
WATCHDOG_S = 1.0
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torch's elastic agent reads each worker's error


def die_with_launcher(launcher_pid: int) -> None:
    """SIGKILL this process as soon as the launcher is gone."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher_pid:  # it died before the signal was set up
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == launcher_pid:
            threading.Event().wait(WATCHDOG_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="meshkit-launcher-watchdog", daemon=True).start()


def run_user_program(run: Callable[[], Any]) -> None:
    """Run it. A MeshkitError (bad input) is recorded for the launcher, which prints it as its one line; no
    rank prints a traceback for it. Any failure is also noted in the launcher's state directory before the
    process ends: the launcher learns of it even if torch's agent reaps the process before it looks."""

    def guarded() -> None:
        try:
            run()
        except SystemExit as stop:
            if stop.code not in (0, None, PREEMPTED_EXIT_CODE):
                note_failure()
            raise
        except KeyboardInterrupt:  # Ctrl-C (twice, where checkpoints are on): the launcher says so in one line
            note_failure()
            exit_now(INTERRUPTED_EXIT_CODE)
        except BaseException as err:
            note_failure()
            write_error_file(err)
            if not isinstance(err, MeshkitError) and not (lost_a_peer(err) and report_peer_loss(err)):
                traceback.print_exc()
            exit_now(2 if isinstance(err, MeshkitError) else 1)

    record(guarded)()


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err` only says that another rank's end of a connection is gone."""
    return any(sign in str(err) for sign in PEER_LOSS)


def report_peer_loss(err: BaseException) -> bool:
    """One line on stderr, the traceback appended to the launcher's log file; False when there is no log file
    (the caller then prints the traceback: nothing is lost)."""
    log = os.environ.get(LAUNCH_LOG_ENV)
    if not log:
        return False
    rank = os.environ.get("RANK", "?")
    try:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "a") as handle:
            handle.write(f"--- rank {rank} (pid {os.getpid()}): a peer is gone\n{traceback.format_exc()}\n")
    except OSError:
        return False
    sign = next(sign for sign in PEER_LOSS if sign in str(err))
    # one write, newline included: print's two writes let another process's line land between them
    sys.stderr.write(
        f"meshkit: rank {rank} stopped: a peer is gone ({type(err).__name__}: {sign}); traceback in {log}\n"
    )
    sys.stderr.flush()
    return True


def write_error_file(err: BaseException) -> None:
    """The error in the elastic agent's error-file format, written atomically: the agent may SIGTERM this
    process at any moment once a peer failed, and a half-written file would break the launcher's report."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        }
    }
    with contextlib.suppress(OSError):
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as handle:
            json.dump(data, handle)
        os.replace(partial, path)


def exit_now(code: int) -> NoReturn:
    """End the process with `code` after flushing its output, skipping interpreter teardown."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def note_failure() -> None:
    state = os.environ.get(LAUNCHER_STATE_ENV)
    if state and os.path.isdir(state):
        with contextlib.suppress(OSError):
            open(os.path.join(state, f"{FAILED_PREFIX}{os.getpid()}"), "w").close()


def main(argv: list[str]) -> None:
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m meshkit.launching.worker [-m] PROGRAM [ARGS...]")
    if LAUNCHER_PID_ENV in os.environ:
        die_with_launcher(int(os.environ[LAUNCHER_PID_ENV]))
    store = host_worker_store(os.environ)  # noqa: F841 - serves the other workers for as long as this runs
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        run_user_program(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        run_user_program(lambda: runpy.run_path(script, run_name="__main__"))


if __name__ == "__main__":
    main(sys.argv[1:])
