"""Saving and loading the whole training state of an engine: collective, atomic, optionally asynchronous.

Every rank writes its own pieces; rank 0 then writes `meta.json` and the manifest and commits the directory
by one rename. With `asynchronous=True` the tensors are copied to host memory while the caller waits (the
"blocking" part) and written by a background thread; rank 0 commits when every rank's writes are done. At
most one save is in flight: the next save (or a load, or `wait()`) first waits for the previous one.
Checkpoint traffic runs on its own gloo group so it never interleaves with training collectives.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from meshkit.checkpoint.canonical import TrainingState
from meshkit.checkpoint.extras import rng_state, set_rng_state
from meshkit.checkpoint.model_match import CheckpointMismatchError
from meshkit.checkpoint.storage import (
    FORMAT_VERSION,
    META,
    CheckpointError,
    file_entries,
    load_tensors,
    rank_file,
    read_record,
    save_tensors,
    stored_shapes,
    verify,
    write_json,
    write_manifest,
    writer,
    written_by_save,
)
from meshkit.core.errors import one_line
from meshkit.runtime import collectives

Commit = Callable[[Path], Path]  # rank 0: turns the fully written partial directory into the checkpoint


class PendingSave:
    """A save whose files are still being written (asynchronous mode)."""

    def __init__(self, upload: Future, committer: threading.Thread | None, target: Path) -> None:
        self.upload = upload
        self.committer = committer
        self.target = target
        self.error: BaseException | None = None

    def wait(self) -> None:
        try:
            self.upload.result()
        except BaseException as err:  # noqa: BLE001 - reported below, on every rank
            self.error = self.error or err
        if self.committer is not None:
            self.committer.join()
        if self.error is not None:
            raise CheckpointError(
                f"the asynchronous save to {self.target} failed ({_first_line(self.error)}); nothing was committed: "
                "the previous checkpoint is intact and still the latest"
            ) from self.error


class Checkpointer:
    """The engine's save/load machinery; `describe()` gives it the state to save."""

    def __init__(self, rank: int, describe: Callable[[], dict[str, Any]], state: Callable[[], TrainingState]) -> None:
        self.rank = rank
        self.describe = describe
        self.state = state
        self._group: dist.ProcessGroup | None = None
        self._pending: PendingSave | None = None
        self._stager: DefaultStager | None = None

    @property
    def stager(self) -> DefaultStager:
        """Copies the state to host memory for an asynchronous save. Kept for the whole run: it reuses its
        host buffers (pinned on CUDA) from one save to the next, so only the first save allocates them."""
        if self._stager is None:
            options = StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
            self._stager = DefaultStager(options)
        return self._stager

    def close(self) -> None:
        """Wait for the save in flight, then free the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait()
        finally:
            self._barrier()

    # ------------------------------------------------------------------ save
    def save(
        self, partial: Path, commit: Commit, *, asynchronous: bool, extra: dict[str, Any], rank_extra: dict[str, Any]
    ) -> None:
        """Write the state to `partial`, then (rank 0) commit it. A failure on any rank fails the save on every
        rank with the same error, after the partial directory is removed; nothing is committed."""
        self.wait()
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self._barrier()
        meta = {"format": FORMAT_VERSION, **self.describe(), "extra": extra}
        state = self.state()
        with state.exposed():
            tensors: dict[str, Any] = {}
            with self._agreed(partial):  # local preparation: every rank learns of any rank's failure
                write_json(partial / rank_file(self.rank), {"rng": rng_state(), **rank_extra})
                meta["hyperparameters"] = state.hyperparameters()
                json.dumps(meta)  # fail here, on every rank, if something is not JSON
                tensors = state.tensors()
            try:  # collective: torch.distributed.checkpoint reports a failure on every rank itself
                if asynchronous:
                    self._start_async(tensors, partial, commit, meta)
                    return
                save_tensors(tensors, partial, self.group)
            except _SAVE_ERRORS as err:
                self._fail(partial, err)
        entries: dict[str, Any] = {}
        with self._agreed(partial):  # the ranks checksum the written files in parallel, a share each
            entries = self._checksum_share(partial)
        if self.group is not None:
            entries = {k: v for part in collectives.gather_object(entries, self.group) for k, v in part.items()}
        with self._agreed(partial):
            if self.rank == 0:
                self._finish(partial, commit, meta, entries)

    def _checksum_share(self, partial: Path) -> dict[str, Any]:
        names = sorted(p.name for p in partial.iterdir() if p.is_file() and written_by_save(p.name))
        world = dist.get_world_size(self.group) if self.group is not None else 1
        mine = dist.get_rank(self.group) if self.group is not None else 0
        return file_entries(partial, names[mine::world])

    @contextlib.contextmanager
    def _agreed(self, partial: Path) -> Iterator[None]:
        """Run a local block; then every rank raises if any rank's block failed."""
        failure: str | None = None
        cause: BaseException | None = None
        try:
            yield
        except _SAVE_ERRORS as err:
            failure, cause = f"rank {self.rank}: {_first_line(err)}", err
        if self.group is not None:
            anyone = torch.tensor([failure is not None], dtype=torch.int32)
            dist.all_reduce(anyone, op=dist.ReduceOp.MAX, group=self.group)
            if anyone.item():  # only then the messages: one small collective when all went well
                failure = next(f for f in collectives.gather_object(failure, self.group) if f)
        if failure is not None:
            self._fail(partial, cause or RuntimeError(failure), failure)

    def _fail(self, partial: Path, err: BaseException, message: str | None = None) -> None:
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(
            f"saving the checkpoint to {partial} failed ({message or _first_line(err)}); nothing was committed: "
            "the previous checkpoint is intact and still the latest"
        ) from err

    def _finish(
        self, partial: Path, commit: Commit, meta: dict[str, Any], entries: dict[str, Any] | None = None
    ) -> Path:
        write_json(partial / META, meta)
        write_manifest(partial, entries)
        return commit(partial)

    def _start_async(self, tensors: dict[str, Any], partial: Path, commit: Commit, meta: dict[str, Any]) -> None:
        response = dcp.async_save(
            tensors, storage_writer=writer(partial), process_group=self.group, async_stager=self.stager
        )
        upload = cast(Future, getattr(response, "upload_completion", response))  # (torch < 2.9: the future itself)
        committer = None
        pending = PendingSave(upload, None, partial)
        if self.rank == 0:

            def finish() -> None:
                try:
                    upload.result()
                    self._finish(partial, commit, meta)
                except BaseException as err:  # noqa: BLE001 - raised by the next wait()
                    pending.error = err
                    shutil.rmtree(partial, ignore_errors=True)

            committer = threading.Thread(target=finish, name="meshkit-checkpoint-commit", daemon=True)
            committer.start()
        pending.committer = committer
        self._pending = pending

    # ------------------------------------------------------------------ load
    def load(self, directory: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Fill the engine's models and optimizers; returns (meta.json, this rank's rank file or None)."""
        self.wait()
        problem = None
        if self.rank == 0:
            try:
                verify(directory)
            except CheckpointError as err:
                problem = str(err)
        problem = collectives.broadcast_object(problem, src=0, group=self.group)
        if problem:
            raise CheckpointError(problem)
        meta = read_record(directory, META, ("format",))
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {directory} has format {meta.get('format')}, expected {FORMAT_VERSION}")
        mine = directory / rank_file(self.rank)
        rank_data = read_record(directory, mine.name, ("rng",)) if mine.is_file() else None
        shapes = stored_shapes(directory)
        state = self.state()

        def read(targets: dict[str, Any]) -> None:
            load_tensors(targets, directory, self.group)

        try:
            with state.exposed():
                state.load(shapes, read, meta.get("hyperparameters"))
        except CheckpointMismatchError as err:
            raise CheckpointError(f"{directory}: {err}") from None
        if rank_data is not None:
            set_rng_state(rank_data["rng"])
        return meta, rank_data


_SAVE_ERRORS = (OSError, RuntimeError, TypeError, ValueError, CheckpointException)


def _first_line(err: BaseException) -> str:
    """The cause in one line, e.g. 'rank 1: OSError: [Errno 28] No space left on device'.

    torch.distributed.checkpoint wraps each failing rank's exception (and `str()` of the wrapper shows only
    their ranks); the innermost exception of the first rank is what the user can act on.
    """
    if isinstance(err, CheckpointException) and err.failures:
        rank, failure = min(err.failures.items())
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {_first_line(inner)}"
    while err.__cause__ is not None and not str(err).strip():
        err = err.__cause__
    lines = [line for line in str(err).splitlines() if line.strip()]
    causes = [line for line in lines if not line.startswith((" ", "Traceback", "CheckpointException"))]
    text = causes[0] if causes else (lines[0] if lines else "")
    name = type(err).__name__
    if not text:
        return name
    return one_line(text if text.startswith(name) else f"{name}: {text}", 300)
