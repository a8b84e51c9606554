"""The engine's checkpoint API — `save_state`, `load_state`, and the periodic `save_checkpoint` / `resume` — as
the Engine's `checkpoints` component, which owns the run's `Checkpointer`."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from meshkit.checkpoint.canonical import TrainingState
from meshkit.checkpoint.directory import commit, partial_dir, remove_partials, resolve_resume, step_dir_name
from meshkit.checkpoint.extras import state_from_json, state_to_json
from meshkit.checkpoint.session import Checkpointer
from meshkit.checkpoint.storage import META, CheckpointError, fsync_dir
from meshkit.core.io import plain_numbers
from meshkit.engine.context import EngineComponent, EngineContext, print_once_per_node
from meshkit.runtime import collectives
from meshkit.runtime.preemption import LAUNCHER_STATE_ENV, Preempted, announce


class Checkpoints(EngineComponent):
    """Saves and restores the prepared models, optimizers, schedulers, loaders, scaler and registered objects."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.checkpointer = Checkpointer(ctx.info.rank, self._describe_for_checkpoint, self._training_state)

    def _training_state(self) -> TrainingState:
        objects = self.ctx.objects
        return TrainingState(
            objects.models, objects.optimizers, objects.split_weights, self.ctx.mesh, objects.tied_aliases
        )

    def _describe_for_checkpoint(self) -> dict[str, Any]:
        scaler = self.ctx.scaler
        return {
            "step": self.step,
            "world_size": self.ctx.info.world_size,
            "layout": self.ctx.mesh.dims.as_dict(),
            "zero_stage": self.ctx.placement.zero_stage,
            "schedulers": [plain_numbers(s.state_dict()) for s in self.ctx.objects.schedulers],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "registered": self._registered_states(),
        }

    # ------------------------------------------------------------------ your own objects
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects with every checkpoint (`save_state`/`save_checkpoint`,
        `load_state`/`resume`), in registration order: anything with `state_dict()` and `load_state_dict()`
        (a scheduler not passed to `prepare`, an EMA helper, a counter). Their state is stored as JSON with
        tensors as raw bytes — never pickled — taken from the main process, as Accelerate does."""
        missing = [f"{i} ({type(o).__name__})" for i, o in enumerate(objects) if not _has_state(o)]
        if missing:
            raise CheckpointError(
                f"register_for_checkpointing: object(s) {', '.join(missing)} lack state_dict() and "
                "load_state_dict(): wrap what they hold in an object that has both"
            )
        self.ctx.objects.registered.extend(objects)

    def _registered_states(self) -> list[Any]:
        states = []
        for index, obj in enumerate(self.ctx.objects.registered):
            try:
                states.append(state_to_json(obj.state_dict(), f"registered object {index} ({type(obj).__name__})"))
            except TypeError as err:
                raise CheckpointError(f"register_for_checkpointing: {err}") from None
        return states

    def _load_registered(self, saved: list[Any], path: Path) -> None:
        registered = self.ctx.objects.registered
        if len(saved) != len(registered):
            raise CheckpointError(
                f"{path} holds {len(saved)} registered object(s) and this run registered {len(registered)}: "
                "call register_for_checkpointing with the same objects, in the same order, before loading"
            )
        for obj, state in zip(registered, saved, strict=True):
            obj.load_state_dict(state_from_json(state))

    # ------------------------------------------------------------------ explicit
    def save_state(
        self, directory: str | os.PathLike[str], *, asynchronous: bool = False, extra: dict[str, Any] | None = None
    ) -> Path:
        """Save everything needed to continue training into `directory` (collective: every rank calls it).

        Model and optimizer (sharded as they are held), schedulers, the step, every rank's RNG states, the
        data position, and `extra` (any JSON, e.g. your own counters). The directory appears complete or not
        at all. With `asynchronous` the call returns once the state is copied; `wait_for_checkpoint()` (or the
        next save) waits for the files.
        """
        target = Path(directory).absolute()

        def finish(partial: Path) -> Path:
            if target.exists():
                raise CheckpointError(f"{target} already exists: choose a new directory or remove it")
            os.replace(partial, target)
            fsync_dir(target.parent)
            return target

        partial = target.parent / f".{target.name}.partial"
        self._save(partial, finish, asynchronous, extra)
        return target

    def _save(self, partial: Path, finish: Any, asynchronous: bool, extra: dict[str, Any] | None) -> None:
        store = self.ctx.placement.checkpoint_store
        if store is not None:  # the placement's own (a parameter server's servers write the weights)
            registered = self._registered_states()
            store.save(partial, finish, self.step, extra or {}, self.ctx.objects.loaders, registered)
            return
        loaders = [loader.state_dict() for loader in self.ctx.objects.loaders]
        self.checkpointer.save(
            partial, finish, asynchronous=asynchronous, extra=extra or {}, rank_extra={"loaders": loaders}
        )

    def load_state(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore a `save_state` checkpoint, at this run's layout and world size; returns its `extra`.

        The layout may differ from the one that saved it (ZeRO-3 at world 4 -> DDP at world 2, TP -> one
        process, pp2 -> pp1): every rank reads exactly its piece of every tensor.
        """
        path = Path(directory)
        if not path.exists():
            raise CheckpointError(f"load_state: {path} does not exist")
        objects, placement = self.ctx.objects, self.ctx.placement
        store = placement.checkpoint_store
        if store is not None:
            extra = store.load(path, objects.optimizers, objects.schedulers, objects.loaders)
            if placement.is_worker:
                self._load_registered(_read_json(path / META).get("registered", []), path)
            return extra
        meta, rank_data = self.checkpointer.load(path)
        self._load_registered(meta.get("registered", []), path)
        for scheduler, state in zip(objects.schedulers, meta.get("schedulers", []), strict=False):
            scheduler.load_state_dict(state)
        if self.ctx.scaler is not None and meta.get("scaler"):
            self.ctx.scaler.load_state_dict(meta["scaler"])
        for optimizer in objects.optimizers:
            optimizer.steps_taken = int(meta["step"])
        # The data position is global (samples read by all ranks together): rank 0's file holds it for all. A
        # stream's own place is each rank's own (its share of the stream), in its own file.
        first = path / "rank-00000.json"
        positions = (rank_data if self.ctx.info.rank == 0 else None) or _read_json(first)
        own = (rank_data or {}).get("loaders", []) if meta.get("layout") == self.ctx.mesh.dims.as_dict() else []
        for index, (loader, state) in enumerate(zip(objects.loaders, positions.get("loaders", []), strict=False)):
            stream = own[index].get("stream") if index < len(own) else None
            if stream is None and state.get("stream") is not None:
                warnings.warn(
                    f"{path} holds each rank's place in its data stream for another layout: this rank reads its "
                    f"share of the stream from the start again and skips the {state.get('batches_seen', 0)} batches "
                    "read",
                    stacklevel=2,
                )
            loader.load_state_dict({**state, "stream": stream})
        if rank_data is None:
            warnings.warn(
                f"{path} has no RNG state for rank {self.ctx.info.rank} (saved by fewer ranks): "
                "this rank keeps its current random state",
                stacklevel=2,
            )
        return meta.get("extra", {})

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save is committed (raises if it failed)."""
        self.checkpointer.wait()

    def close(self) -> None:
        self.checkpointer.close()

    # ------------------------------------------------------------------ periodic (config `checkpoint`)
    @property
    def checkpoint_root(self) -> Path:
        cfg = self.ctx.config.checkpoint
        return Path(cfg.dir) if cfg.dir is not None else Path(self.ctx.config.logging.dir) / "checkpoints"

    def arm_preemption(self) -> None:
        """Take the preemption signal from now on (the first `save_checkpoint()` does it otherwise): for a loop
        that calls `save_checkpoint()` every step, so that a signal during its first step stops it at a checkpoint
        too. A loop that never calls it must not arm: the signal would be noted and never acted on."""
        if self.ctx.placement.every_rank_meets:  # (as in save_checkpoint: the agreement is a collective)
            self.ctx.preemption.arm()

    def save_checkpoint(self, *, extra: dict[str, Any] | None = None, force: bool = False) -> Path | None:
        """Save `<root>/step-NNNNNN/` when the step is a multiple of `checkpoint.every_steps` (or `force`);
        moves `latest` and keeps the newest `checkpoint.keep_last`. Returns the directory, or None.

        Call it once per step on every rank: it is also where a preemption signal (`checkpoint.preempt_signal`,
        SIGTERM by default) takes effect — every rank saves here at the same step, then the process exits
        with code 75 (`meshkit.runtime.preemption.Preempted`), and `resume: auto` continues from it.
        """
        cfg = self.ctx.config.checkpoint
        watch = self.ctx.preemption
        placement = self.ctx.placement
        if not placement.is_worker:
            return None  # (a parameter server saves while it serves, when the workers ask)
        if placement.every_rank_meets:  # (the agreement is a collective over every rank, which a lost one would miss)
            watch.arm()
        preempted = watch.agreed()
        due = cfg.every_steps > 0 and self.step > 0 and self.step % cfg.every_steps == 0
        if not (due or force or preempted):
            return None
        root, step = self.checkpoint_root, self.step
        self.checkpointer.wait()  # the save in flight first: cleanup below must never touch its directory
        if self.ctx.info.rank == 0 and placement.checkpoint_store is None:
            root.mkdir(parents=True, exist_ok=True)
            remove_partials(root)
        self._save(partial_dir(root, step), lambda p: commit(p, root, step, cfg.keep_last), cfg.async_save, extra)
        saved = root / step_dir_name(step)
        if preempted:
            self.checkpointer.wait()
            stop = Preempted(step, watch.signal_name)
            print_once_per_node(
                self.ctx.info,
                f"meshkit: {watch.signal_name} received: checkpoint {saved} committed at step {step}; exiting with "
                f"code {stop.code} (run the job again with checkpoint.resume=auto to continue)",
                flush=True,
            )
            if self.ctx.info.local_rank == 0:
                announce(os.environ.get(LAUNCHER_STATE_ENV), step, saved, watch.signal_name)
            raise stop
        return saved

    def resume(self) -> dict[str, Any] | None:
        """Load what `checkpoint.resume` names (auto: the newest good checkpoint); returns its `extra`, or None
        when there is nothing to resume. Corrupt checkpoints are skipped with a warning naming them."""
        placement = self.ctx.placement
        if not placement.is_worker:
            return None  # (a parameter server served already: the workers' resume restored its shards)
        store = placement.checkpoint_store
        if store is not None:
            chosen = store.resume_choice(self.ctx.config.checkpoint.resume, self.checkpoint_root)
            return self._resume_from(chosen)
        choice = None
        if self.ctx.info.rank == 0:
            try:
                found = resolve_resume(self.ctx.config.checkpoint.resume, self.checkpoint_root)
                choice = ("ok", str(found) if found else None)
            except CheckpointError as err:
                choice = ("error", str(err))
        kind, value = collectives.broadcast_object(choice, src=0)
        if kind == "error":
            raise CheckpointError(value)
        return self._resume_from(value)

    def _resume_from(self, value: str | None) -> dict[str, Any] | None:
        if value is None:
            return None
        extra = self.load_state(value)
        print_once_per_node(self.ctx.info, f"meshkit: resumed from {value} at step {self.step}")
        return extra


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
