"""`Engine`: the one object a training script touches.

It resolves the config, joins the process group, builds the one device mesh, and prepares the model,
optimizer, scheduler and data for the layout. Two loop styles are first-class:

    loss = loss_fn(model(x), y); engine.backward(loss); optimizer.step(); optimizer.zero_grad()
    loss = engine.train_step(batch)     # forward, backward and step in one call (also drives pipelines)

The Engine is composed of components it owns, each reading the one shared `EngineContext`: `processes` (ranks,
metrics, barriers, trackers), `stepping` (backward, train_step), `checkpoints`, `weights`, `evaluation` and
`preparation`. Their verbs are the Engine's own attributes (`engine.save_state` is `engine.checkpoints.save_state`).
Accelerate's surface is not here: `meshkit.Accelerator` (compat/accelerate/) has an Engine and answers with
Accelerate's names and meanings.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from meshkit.config.idle import idle_values
from meshkit.config.resolve import ResolvedConfig, explicit_values, resolve
from meshkit.config.schema import RunConfig
from meshkit.core.seed import set_seed
from meshkit.engine.checkpointing import Checkpoints
from meshkit.engine.context import EngineContext
from meshkit.engine.delegation import Attribute, Verb
from meshkit.engine.evaluation import Evaluation
from meshkit.engine.gradients import gradient_sync
from meshkit.engine.layout_auto import settle_layout
from meshkit.engine.placement import Placement, place
from meshkit.engine.preparation import Preparation
from meshkit.engine.prepared_objects import EngineError, PreparedObjects
from meshkit.engine.processes import Processes
from meshkit.engine.stepping import Stepping
from meshkit.engine.weights import Weights
from meshkit.launching.affinity import apply_affinity
from meshkit.launching.worker import LAUNCHER_PID_ENV
from meshkit.parallel.dataparallel import WrappedModelWarning  # noqa: F401 - re-exported
from meshkit.runtime.hang_doctor import HangDoctor
from meshkit.runtime.host_memory import ResidentGuard
from meshkit.runtime.mesh import ParallelMesh, ProcessInfo, select_device, start_process_group, stop_process_group
from meshkit.runtime.preemption import Preempted, PreemptionWatch
from meshkit.runtime.tracking import TrackerSet, check_trackers
from meshkit.training.accumulation import GradientState
from meshkit.training.loss import (
    LossFn,
)
from meshkit.training.precision import make_grad_scaler

__all__ = ["ConfigConflictWarning", "Engine", "EngineError", "WrappedModelWarning"]


class ConfigConflictWarning(UserWarning):
    """Code and a launch flag set the same key to different values (code wins)."""


class Engine:
    """Distributed training for any layout. `Engine(config=None, **overrides)`.

    `config` is a RunConfig, a YAML path, the result of `meshkit.config.resolve.resolve()`, or None (the config
    file, environment and launch flags apply).
    Keyword overrides are code arguments, the highest-precedence source: `Engine(precision="bf16", tp=2)`.
    """

    # ------------------------------------------------------------------ ranks, metrics, barriers (processes)
    process_index = Attribute[int]("processes", Processes)
    num_processes = Attribute[int]("processes", Processes)
    dp_rank = Attribute[int]("processes", Processes)
    dp_size = Attribute[int]("processes", Processes)
    is_worker = Attribute[bool]("processes", Processes)
    is_main_worker = Attribute[bool]("processes", Processes)
    is_main_process = Attribute[bool]("processes", Processes)
    is_local_main_process = Attribute[bool]("processes", Processes)
    gather = Verb("processes", Processes.gather)
    gather_for_metrics = Verb("processes", Processes.gather_for_metrics)
    reduce = Verb("processes", Processes.reduce)
    wait_for_everyone = Verb("processes", Processes.wait_for_everyone)
    main_process_first = Verb("processes", Processes.main_process_first)
    main_process_work = Verb("processes", Processes.main_process_work)
    print = Verb("processes", Processes.print)
    log = Verb("processes", Processes.log)
    start_trackers = Verb("processes", Processes.start_trackers)
    # ------------------------------------------------------------------ checkpoints
    step = Attribute[int]("checkpoints", Checkpoints)
    register_for_checkpointing = Verb("checkpoints", Checkpoints.register_for_checkpointing)
    save_state = Verb("checkpoints", Checkpoints.save_state)
    load_state = Verb("checkpoints", Checkpoints.load_state)
    wait_for_checkpoint = Verb("checkpoints", Checkpoints.wait_for_checkpoint)
    save_checkpoint = Verb("checkpoints", Checkpoints.save_checkpoint)
    resume = Verb("checkpoints", Checkpoints.resume)
    # ------------------------------------------------------------------ the step
    accumulate = Verb("stepping", Stepping.accumulate)
    backward = Verb("stepping", Stepping.backward)
    clip_grad_norm_ = Verb("stepping", Stepping.clip_grad_norm_)
    weigh_token_losses = Verb("stepping", Stepping.weigh_token_losses)
    leave_out_of_steps = Verb("stepping", Stepping.leave_out_of_steps)
    loss_parallel = Verb("stepping", Stepping.loss_parallel)
    shard_sequence = Verb("stepping", Stepping.shard_sequence)
    train_step = Verb("stepping", Stepping.train_step)
    objective_step = Verb("stepping", Stepping.objective_step)
    # ------------------------------------------------------------------ weights, memory, evaluation
    unwrap_model = Verb("weights", Weights.unwrap_model)
    full_state_dict = Verb("weights", Weights.full_state_dict)
    load_full_state_dict = Verb("weights", Weights.load_full_state_dict)
    memory_report = Verb("weights", Weights.memory_report)
    activation_report = Verb("weights", Weights.activation_report)
    save_model = Verb("weights", Weights.save_model)
    eval_token_loss = Verb("evaluation", Evaluation.eval_token_loss)
    prepare_frozen = Verb("preparation", Preparation.prepare_frozen)

    def __init__(
        self, config: RunConfig | ResolvedConfig | str | os.PathLike[str] | None = None, **overrides: Any
    ) -> None:
        if isinstance(config, ResolvedConfig):
            if overrides:
                raise EngineError("Engine(config=<resolved config>) takes no further overrides: add them to resolve()")
            self.resolved = config
        else:
            file = config if isinstance(config, (str, os.PathLike)) else None
            code = {**explicit_values(config), **overrides} if isinstance(config, RunConfig) else overrides
            self.resolved = resolve(code=code, file=file)
        config_ = self.resolved.config
        self._layout_pending = config_.layout == "auto"  # probed at prepare(model, optimizer, loader)
        self.layout_probe: list[Any] | None = None  # layout: auto: every candidate probed (`layout_probe.Candidate`)
        self.info = ProcessInfo.from_env()
        self.device = select_device(config_.device, self.info.local_rank)
        self.affinity = apply_affinity(self.info.local_rank, self.info.local_world_size, config_.threads_per_process)
        check_trackers(config_.logging.trackers)
        self._owns_process_group = start_process_group(self.info, self.device, config_.collective_timeout_s)
        placement, gradient_state, scaler = self._laid_out(config_)
        cpu = self.device.type == "cpu"  # (a device of its own keeps the tensors: nothing for the host to hand back)
        self._resident = ResidentGuard(config_.host_memory_slack_mb if cpu else None)
        doctor = (
            HangDoctor(self.info.rank, self.info.world_size, config_.collective_timeout_s)
            if config_.hang_doctor and self.info.world_size > 1
            else None
        )
        self.ctx = EngineContext(
            config=config_,
            info=self.info,
            device=self.device,
            placement=placement,
            gradient_state=gradient_state,
            scaler=scaler,
            objects=PreparedObjects(),
            trackers=self._trackers(config_, placement),
            preemption=PreemptionWatch(config_.checkpoint.preempt_signal, self.info.world_size),
            hang_doctor=doctor,
        )
        self._gradients = gradient_sync(self.ctx)
        self.checkpoints = Checkpoints(self.ctx)
        self.stepping = Stepping(self.ctx, lambda: self._gradients, lambda: self.checkpoints.step)
        self.processes = Processes(self.ctx, lambda: self.checkpoints.checkpointer.group)
        self.weights = Weights(self.ctx)
        self.evaluation = Evaluation(self.ctx)
        self.preparation = Preparation(self.ctx, lambda: self._gradients, self._resident.after_step)
        if self.is_main_process:
            for conflict in self.resolved.conflicts:
                warnings.warn(conflict.message(), ConfigConflictWarning, stacklevel=2)
        # Values that change nothing here: meshkit's launcher named those it saw; code values only the Engine sees.
        only = ("code",) if LAUNCHER_PID_ENV in os.environ else ()
        for note in idle_values(config_, self.resolved.sources, only):
            self._say_once(f"meshkit: {note}")

    def _laid_out(self, config: RunConfig) -> tuple[Placement, GradientState, Any]:
        """What follows the layout: the device mesh and placement, the seed, the accumulation state and the loss
        scaler (built again once `layout: auto` has chosen)."""
        try:
            placement = place(config, self.info, self.device, self._say_once)
        except Exception:
            self._leave_process_group(wait_for_peers=False)
            raise
        set_seed(config.seed)
        sharded_over = placement.mesh.grad_group if placement.zero_stage else None
        scaler = make_grad_scaler(config.precision, self.device, sharded_over)
        return placement, GradientState(accum_steps=config.grad_accum_steps), scaler

    def _trackers(self, config: RunConfig, placement: Placement) -> TrackerSet:
        settings = config.model_dump(mode="json")  # the resolved run config, for trackers that record it
        return TrackerSet(config.logging.trackers, config.logging.dir, settings, self._reports(placement))

    def _say_once(self, line: str) -> None:
        if self.info.rank == 0:
            print(line, flush=True)

    def _reports(self, placement: Placement) -> bool:
        return self.info.rank == placement.reporting_rank

    def _adopt_layout(self, chosen: ResolvedConfig) -> None:
        """`layout: auto` chose: lay the engine out again in `chosen` (the components see it through the context)."""
        config = chosen.config
        self.resolved, self.ctx.config = chosen, config
        self.ctx.placement, self.ctx.gradient_state, self.ctx.scaler = self._laid_out(config)
        self._gradients = gradient_sync(self.ctx)
        if not self.ctx.trackers.started:  # they record the chosen layout
            self.ctx.trackers = self._trackers(config, self.ctx.placement)

    # ------------------------------------------------------------------ where am I
    @property
    def config(self) -> RunConfig:
        return self.ctx.config

    @property
    def mesh(self) -> ParallelMesh:
        return self.ctx.mesh

    @property
    def zero_stage(self) -> int:
        return self.ctx.placement.zero_stage

    @property
    def placement(self) -> Placement:
        """Where this rank sits in the run's layout: its mesh, groups and ranks, whether the ranks step together
        (under `strategy: parameter_server`, a `ServedPlacement`: its `run` holds the roles and the servers' report)."""
        return self.ctx.placement

    @property
    def gradient_state(self) -> GradientState:
        return self.ctx.gradient_state

    @property
    def scaler(self) -> Any:
        return self.ctx.scaler

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step that synchronises gradients and steps the optimizer."""
        return self.ctx.gradient_state.sync

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects: Any, loss_fn: LossFn | None = None) -> Any:
        """Place and wrap models, optimizers, data loaders and LR schedulers; returns them in the same order."""
        if self._layout_pending:  # layout: auto: the layouts are probed on these objects, the fastest laid out
            self._layout_pending = False
            chosen, self.layout_probe, objects = settle_layout(self, objects, loss_fn)
            self._adopt_layout(chosen)
        prepared = self.preparation.prepare(objects, loss_fn)
        self.ctx.placement.start(self.ctx.objects.optimizers, self.ctx.objects.schedulers)  # (a server serves here)
        return prepared

    # ------------------------------------------------------------------ end
    def end(self, *, wait_for_peers: bool = True) -> None:
        """Close the trackers and leave the process group (if this engine created it). Safe to call twice.

        With `wait_for_peers` every rank first meets the others at a barrier, so no rank tears its
        communicator down while a peer is still talking to it; pass False on an error path, where a peer
        may be gone.
        """
        if wait_for_peers:
            self.checkpoints.close()
            self.ctx.placement.finish()  # (a parameter-server worker tells the servers: they return from prepare())
        self.ctx.preemption.disarm()
        if self.ctx.hang_doctor is not None:
            self.ctx.hang_doctor.stop()
            self.ctx.hang_doctor = None
        self.ctx.trackers.close()  # (already closed above, unless this is an error path)
        # (where ranks may be lost, e.g. parameter-server workers, the run ends without a closing barrier)
        self._leave_process_group(wait_for_peers and self.ctx.placement.every_rank_meets)

    def _leave_process_group(self, wait_for_peers: bool) -> None:
        if self._owns_process_group:
            stop_process_group(wait_for_peers)
        self._owns_process_group = False

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None or not issubclass(exc_type, Preempted):
            self.end(wait_for_peers=exc_type is None)
            return
        # A preemption stop is agreed by every rank: they leave together, as after a normal end — unless the
        # launcher, told the checkpoint is committed, already stops the peers: then leave without them.
        try:
            self.end(wait_for_peers=True)
        except RuntimeError:
            self.end(wait_for_peers=False)
