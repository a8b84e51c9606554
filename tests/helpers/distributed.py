"""Start a real world of gloo ranks on a free port, with a hard timeout: a hang fails the test, never CI."""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pkgutil
import queue
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist

import meshkit
from meshkit.launching.interfaces import quiet_port
from meshkit.runtime.mesh import stop_process_group


def meshkit_modules() -> list[str]:
    """Every module of the meshkit package, by name (entry points excluded)."""
    found = pkgutil.walk_packages(meshkit.__path__, "meshkit.")
    return ["meshkit", *(module.name for module in found if not module.name.endswith("__main__"))]


def free_port() -> int:
    """A free loopback port outside the ephemeral range (two pytest workers' worlds run side by side)."""
    return quiet_port()


def leave_world() -> None:
    """Leave the default process group together: a rank that left while a peer still read its last collective
    would close the peer's connection under it (gloo: "Connection closed by peer")."""
    stop_process_group(wait_for_peers=True)


@contextlib.contextmanager
def gloo_world() -> Iterator[None]:
    """The default gloo process group around a rank's work: left together at the end, at once on an error (the
    rank reports its traceback; a peer may never reach the barrier)."""
    dist.init_process_group("gloo")
    try:
        yield
    except BaseException:
        stop_process_group(wait_for_peers=False)
        raise
    leave_world()


# Imported once by the fork server, not by every rank: torch and every meshkit module (~5 s a rank: the engine
# alone brings torch's pipelining, DTensor and dynamo, 1.6 s), and where the hf extra is installed transformers,
# peft, datasets and bitsandbytes (~4 s more; the server skips a module it cannot import). meshkit's modules import
# their optional dependencies (Ray, trackers) only when used, and start no threads, so forking after them is safe.
PRELOADED = [
    "torch",
    "torch.distributed",
    *meshkit_modules(),
    "transformers",
    "transformers.models.llama.modeling_llama",
    "peft",
    "peft.tuners.lora",
    "datasets",
    "bitsandbytes",
]


def _context() -> Any:
    """Ranks fork from a server that has imported the PRELOADED modules once; each rank then takes the test's
    environment and working directory as they are now, as spawn would."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


class _ParentFd:
    """The parent's file descriptor as it is now (a test capturing output redirects 1 and 2), sent to the rank."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(duplicate: Any) -> int:
    return duplicate.detach()


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple, env: dict, parent: tuple
) -> None:
    cwd, inherited, stdout, stderr = parent
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(
        {
            **inherited,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    torch.set_num_threads(1)
    try:
        # Tensors go back as bytes: a queue would share their memory with a process about to exit.
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


# A rank that lost a peer fails with one of these: the cause is elsewhere (another rank's error or exit).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "recvValueWithTimeout failed")


def _failure(rank: int, value: str, results: Any, procs: list, outcome: dict[int, tuple[bool, Any]]) -> AssertionError:
    """The failure to report. A lost peer is a consequence: the others get a moment to report, and the cause is
    shown (another rank's error first), or else which ranks had already finished or exited."""
    failures = {rank: value}
    if any(sign in value for sign in PEER_LOST):
        grace = time.monotonic() + 5.0
        while time.monotonic() < grace:
            try:
                other, ok, text = results.get(timeout=0.2)
            except queue.Empty:
                if all(p.exitcode is not None for r, p in enumerate(procs) if r not in failures and r not in outcome):
                    break  # every other rank has ended, and what they said has been read
                continue
            if ok:
                outcome[other] = (ok, text)
            else:
                failures[other] = text
    causes = [r for r, text in failures.items() if not any(sign in text for sign in PEER_LOST)]
    chosen = causes[0] if causes else rank
    notes = []
    if not causes:
        finished = sorted(outcome)
        exited = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None and r not in failures}
        exited = {r: code for r, code in exited.items() if r not in outcome}
        if finished:
            notes.append(f"ranks {finished} had finished")
        if exited:
            notes.append(f"ranks exited without a result (exit codes): {exited}")
    others = sorted(set(failures) - {chosen})
    if others:
        notes.append(f"ranks {others} failed too")
    note = f" ({'; '.join(notes)})" if notes else ""
    return AssertionError(f"rank {chosen} failed{note}:\n{failures[chosen]}")


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    may_die: frozenset[int] = frozenset(),
) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` processes; returns the results in rank order.

    `fn` must be importable (module level) and return tensors, numbers, strings, lists or dicts of them.
    Any rank's exception fails with that rank's traceback; a world that does not finish within `timeout`
    seconds is killed and fails with the ranks that were missing. Ranks in `may_die` may end without a result
    (a fault-injection test kills them): theirs is None.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    parent = (os.getcwd(), dict(os.environ), _ParentFd(1), _ParentFd(2))
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, results, args, env or {}, parent), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcome) < world_size:
            for r in may_die - set(outcome):
                if procs[r].exitcode is not None:
                    outcome[r] = (True, None)
            if len(outcome) == world_size:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s (hang?)")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in outcome and r not in may_die
                ]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise _failure(rank, value, results, procs, outcome)
            outcome[rank] = (ok, value)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [
        None if outcome[rank][1] is None else torch.load(io.BytesIO(outcome[rank][1]), weights_only=True)
        for rank in range(world_size)
    ]
