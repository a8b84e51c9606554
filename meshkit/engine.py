"""`Engine`: the one object a training script touches.

It resolves the config, joins the process group, builds the one device mesh, and prepares the model,
optimizer, scheduler and data for the layout. Two loop styles are first-class:

    loss = loss_fn(model(x), y); engine.backward(loss); optimizer.step(); optimizer.zero_grad()
    loss = engine.train_step(batch)     # forward, backward and step in one call (also drives pipelines)
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as tensor_parallel_loss
from torch.utils.data import DataLoader

from meshkit import collectives
from meshkit.accelerate_loop_verbs import AccelerateLoopVerbs
from meshkit.accelerate_verbs import AccelerateVerbs
from meshkit.accumulation import GradientState, PreparedOptimizer, PreparedScheduler
from meshkit.checkpoint.engine_mixin import CheckpointingMixin
from meshkit.config import RunConfig
from meshkit.data.loader import ShardedLoader
from meshkit.engine_auto import settle_layout
from meshkit.engine_data import DataMixin
from meshkit.engine_weights import EngineError, WeightsMixin
from meshkit.evaluation import EvaluationMixin
from meshkit.gradients import GradientSync, clip_arguments
from meshkit.hang_doctor import HangDoctor, watched
from meshkit.host_memory import ResidentGuard
from meshkit.launching.affinity import apply_affinity
from meshkit.loss import (
    IGNORE_INDEX,
    CausalLMLoss,
    LossFn,
    compute_loss,
    is_causal_lm_batch,
    logits_of,
    pipeline_pair,
    split_causal_lm_batch,
    token_loss_sum,
)
from meshkit.mesh import ParallelDims, ParallelMesh, ProcessInfo, select_device, start_process_group
from meshkit.models.adapters import LoraMerge, lora_merges
from meshkit.parallel.activation import CheckpointedBlock
from meshkit.parallel.compose import parallelize, unwrap
from meshkit.parallel.context import shard_sequence
from meshkit.parallel.dataparallel import WrappedModelWarning, bare_module, check_world  # noqa: F401 - re-exported
from meshkit.parallel.nvme import check_offload_dir
from meshkit.parallel.pipeline import PipelineModel
from meshkit.parallel.pipeline_schedule import PipelineRunner
from meshkit.parallel.pipeline_tied import TiedAcrossStages
from meshkit.parallel.replicate import GradientAllReduce
from meshkit.parallel.sharding import effective_zero_stage, rebind_params, renamed_parameters, shard_optimizer
from meshkit.paramserver.run import ParameterServerRun
from meshkit.precision import make_grad_scaler
from meshkit.preemption import Preempted, PreemptionWatch
from meshkit.processes import ProcessHelpers
from meshkit.resolve import ResolvedConfig, explicit_values, resolve
from meshkit.seed import set_seed
from meshkit.tracking import TrackerSet, check_trackers
from meshkit.tree import map_tensors


class ConfigConflictWarning(UserWarning):
    """Code and a launch flag set the same key to different values (code wins)."""


class Engine(
    ProcessHelpers, CheckpointingMixin, WeightsMixin, EvaluationMixin, DataMixin, AccelerateVerbs, AccelerateLoopVerbs
):
    """Distributed training for any layout. `Engine(config=None, **overrides)`.

    `config` is a RunConfig, a YAML path, the result of `meshkit.resolve.resolve()`, or None (the config
    file, environment and launch flags apply).
    Keyword overrides are code arguments, the highest-precedence source: `Engine(precision="bf16", tp=2)`.
    """

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
        self.config: RunConfig = self.resolved.config
        self._layout_pending = self.config.layout == "auto"  # probed at prepare(model, optimizer, loader)
        self.layout_probe: list[Any] | None = None  # layout: auto: every candidate probed (`layout_probe.Candidate`)
        self.info = ProcessInfo.from_env()
        self.device = select_device(self.config.device, self.info.local_rank)
        self.affinity = apply_affinity(
            self.info.local_rank, self.info.local_world_size, self.config.threads_per_process
        )
        check_trackers(self.config.logging.trackers)
        self._owns_process_group = start_process_group(self.info, self.device, self.config.collective_timeout_s)
        # id(original parameter) -> the one splitting put in its place (None: it lives on another pipeline stage)
        self._renamed_params: dict[int, nn.Parameter | None] = {}
        self._pipeline: PipelineRunner | None = None
        self.loss_fn: LossFn | None = None
        self._models: list[nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._registered: list[Any] = []  # engine.register_for_checkpointing
        self._loaders: list[ShardedLoader] = []
        self._logits_sharded = False  # a prepared model returns vocab-sharded logits (tensor parallel)
        self._fused_qkv: dict[int, dict[str, int]] = {}  # id(prepared model) -> interleaved weights and their dim
        self._tied_aliases: dict[int, dict[str, str]] = {}  # id(prepared model) -> tied name -> stored name
        self._adapter_merges: dict[int, dict[str, LoraMerge]] = {}  # id(prepared model) -> LoRA layers to fold
        self._user_modules: dict[int, nn.Module] = {}  # id(prepared model) -> the module the user passed
        self._causal_lm = False  # the prepared model is a causal LM (next-token logits)
        self._uneven: tuple[int, int] | None = None  # (this rank's samples, all ranks') under per-rank batch sizes
        self._checkpointed: list[CheckpointedBlock] = []  # blocks under activation checkpointing/offload
        self._lay_out()
        self._checkpointer = self._make_checkpointer()
        cpu = self.device.type == "cpu"  # (a device of its own keeps the tensors: nothing for the host to hand back)
        self._resident = ResidentGuard(self.config.host_memory_slack_mb if cpu else None)
        self._preemption = PreemptionWatch(self.config.checkpoint.preempt_signal, self.info.world_size)
        self._doctor = (
            HangDoctor(self.info.rank, self.info.world_size, self.config.collective_timeout_s)
            if self.config.hang_doctor and self.info.world_size > 1
            else None
        )
        settings = self.config.model_dump(mode="json")  # the resolved run config, for trackers that record it
        self._trackers = TrackerSet(self.config.logging.trackers, self.run_dir, settings, self.is_main_worker)
        if self.is_main_process:
            for conflict in self.resolved.conflicts:
                warnings.warn(conflict.message(), ConfigConflictWarning, stacklevel=2)

    def _lay_out(self) -> None:
        """The device mesh and everything that follows the layout (again once `layout: auto` has chosen)."""
        try:
            dims = ParallelDims.from_config(self.config.parallel, self.info.world_size)
            if dims.pp > 1 and self.config.grad_accum_steps > 1:
                raise EngineError(
                    "pipeline parallel accumulates over its micro-batches: set grad_accum_steps=1 and raise "
                    "pipeline.microbatches instead"
                )
            if self.config.strategy == "dataparallel":
                check_world(self.info.world_size)
            self.mesh = ParallelMesh(dims, self.info, self.device)
            self._ps = (
                ParameterServerRun(self.config, self.info.rank, self.info.world_size, self._say_once)
                if self.config.strategy == "parameter_server"
                else None
            )
            self.zero_stage = effective_zero_stage(self.config.sharding, self.mesh)
            if self.config.sharding.offload == "nvme":
                check_offload_dir(self.config.sharding.offload_dir)
        except Exception:
            self._stop_process_group()
            raise
        set_seed(self.config.seed)
        self.gradient_state = GradientState(accum_steps=self.config.grad_accum_steps)
        sharded_over = self.mesh.grad_group if self.zero_stage else None
        self.scaler = make_grad_scaler(self.config.precision, self.device, sharded_over)
        # where gradients, metrics and barriers go: a parameter-server worker keeps its gradients to itself
        # (the servers average them) and shares metrics and barriers with the other workers only
        self._grad_group = self._ps.local_group if self._ps else self.mesh.grad_group
        self._data_group = self._ps.workers_group if self._ps else self.mesh.dp_group
        self._metric_group = self._ps.workers_group if self._ps else self.mesh.grad_group
        self._barrier_group = self._ps.workers_group if self._ps else None
        self._gradients = GradientSync(
            self.gradient_state,
            self.scaler,
            self._grad_group,
            self._models,
            self._optimizers,
            self.loss_parallel,
            self.mesh.group("pp") if dims.pp > 1 else None,
        )

    # ------------------------------------------------------------------ where am I
    @property
    def run_dir(self) -> Path:
        return self.config.logging.dir

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step that synchronises gradients and steps the optimizer."""
        return self.gradient_state.sync

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects: Any, loss_fn: LossFn | None = None) -> Any:
        """Place and wrap models, optimizers, data loaders and LR schedulers; returns them in the same order."""
        if self._layout_pending:  # layout: auto: the layouts are probed on these objects, the fastest laid out
            objects, self._layout_pending = settle_layout(self, objects, loss_fn), False
        prepared = self._prepare(objects, loss_fn)
        if self._ps is not None:  # a worker pulls the servers' weights; a server serves until the workers finish
            self._ps.start(self._optimizers, self._schedulers)  # (not a phase: serving may rightly take days)
        return prepared

    @watched("prepare")
    def _prepare(self, objects: tuple[Any, ...], loss_fn: LossFn | None) -> Any:
        if loss_fn is not None:
            self.loss_fn = loss_fn
        prepared: dict[int, Any] = {}
        # Models first: an optimizer or scheduler must see the model's final parameters.
        for index, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                prepared[index] = self._prepare_model(obj)
        for index, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                continue
            if isinstance(obj, torch.optim.Optimizer):
                prepared[index] = self._remember(self._optimizers, self._prepare_optimizer(obj))
            elif isinstance(obj, DataLoader):
                prepared[index] = self._remember(self._loaders, self._prepare_loader(obj))
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or hasattr(obj, "get_last_lr"):
                prepared[index] = self._remember(self._schedulers, PreparedScheduler(obj, self.gradient_state))
            else:
                raise EngineError(
                    f"prepare() takes models, optimizers, DataLoaders and LR schedulers, not {type(obj).__name__}"
                )
        result = [prepared[i] for i in range(len(objects))]
        return result[0] if len(result) == 1 else tuple(result)

    @staticmethod
    def _remember(registry: list[Any], obj: Any) -> Any:
        registry.append(obj)
        return obj

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        model = bare_module(model, self.config.strategy)
        originals = list(model.named_parameters(remove_duplicate=False))  # tied weights: every name
        merges = lora_merges(model)  # before a pipeline split: the whole model's adapter layers
        done = parallelize(model, self.mesh, self.config, self.zero_stage)
        now = dict(unwrap(done.model).named_parameters(remove_duplicate=False))
        self._renamed_params.update(renamed_parameters(originals, now))
        self._logits_sharded |= done.logits_sharded
        self._fused_qkv[id(done.model)] = done.fused_qkv
        self._adapter_merges[id(done.model)] = merges
        self._user_modules[id(done.model)] = model
        self._tied_aliases[id(done.model)] = done.structure.aliases() if done.structure else {}
        self._causal_lm = done.structure is not None and done.structure.causal_lm  # HF batches get the LM loss
        if done.notice:
            self.print(done.notice)
        self._checkpointed.extend(done.checkpointed)
        if done.partial_over_tp:
            partial = [now[name] for name in done.partial_over_tp if name in now]
            self._gradients.model_reducers.append(GradientAllReduce(partial, self.mesh.group("tp"), average=False))
        if done.needs_gradient_reduce:
            self._gradients.model_reducers.append(GradientAllReduce(list(now.values()), self.mesh.grad_group))
        if isinstance(done.model, PipelineModel):
            loss_fn = self.loss_fn
            if loss_fn is None and done.structure is not None and done.structure.causal_lm:
                loss_fn = CausalLMLoss()  # HF batches with labels: the token-mean next-token loss
            self._pipeline = PipelineRunner(done.model, self.mesh, self.config.pipeline, loss_fn)
            if done.structure is not None and done.structure.tied:
                tied = TiedAcrossStages(done.model, done.structure, self.mesh)
                self._gradients.model_reducers.append(tied)
                self._gradients.counted_elsewhere |= tied.counted_elsewhere
        return self._remember(self._models, done.model)

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        optimizer = rebind_params(optimizer, self._renamed_params)
        if self._ps is not None:
            return self._ps.prepare_optimizer(optimizer, self._models, self.gradient_state)
        elsewhere = self._gradients.reduced_by_models()  # ZeRO leaves these gradients to their reducers
        sharded = shard_optimizer(optimizer, self._models, self.mesh, self.config, self.zero_stage, elsewhere)
        return PreparedOptimizer(sharded, self.gradient_state, self.scaler, self._resident.after_step)

    # ------------------------------------------------------------------ the step
    def accumulate(self, *models: nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-step: gradients synchronise (and the optimizer steps) on every grad_accum_steps-th. Models
        may be named, as with Accelerate (`accumulate(model)`); every prepared model takes part either way."""
        return self._gradients.accumulate()

    @watched("backward")
    def backward(self, loss: torch.Tensor, *, num_items: float | torch.Tensor | None = None) -> None:
        """Backward with accumulation scaling (and fp16 loss scaling).

        Without `num_items` each micro-step's loss counts 1/grad_accum_steps. With it, `loss` is the mean over
        `num_items` items (e.g. tokens) and the final gradient is the mean over every item of the window on
        every dp rank — the right average when micro-batches hold different numbers of tokens.
        """
        if num_items is None and self._uneven is not None:  # per-rank batch sizes: weigh each rank by its samples
            mine, total = self._uneven
            self._gradients.backward(loss, mine, global_items=lambda: float(total))
            return
        self._gradients.backward(loss, num_items)

    def clip_grad_norm_(self, *args: Any, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip every prepared model's gradients (unscaled first under fp16); None on non-syncing micro-steps.
        `(max_norm[, norm_type])`, or Accelerate's `(parameters, max_norm[, norm_type])`."""
        return self._gradients.clip_grad_norm_(*clip_arguments(args, norm_type))

    def loss_parallel(self) -> contextlib.AbstractContextManager[Any]:
        """Where the loss is computed from vocab-sharded logits (tensor parallel): cross-entropy without ever
        gathering the full logits. `train_step` and `backward` enter it themselves; a hand-written loop wraps
        its loss computation: `with engine.loss_parallel(): loss = loss_fn(model(x), y)`."""
        return tensor_parallel_loss() if self._logits_sharded else contextlib.nullcontext()

    def shard_sequence(self, batch: Any, dim: int = 1) -> Any:
        """Under context parallel, this rank's two chunks of every tensor's sequence dim (`train_step` does
        it itself; a hand-written loop calls it on each batch). Without cp the batch is returned as is."""
        cp = self.mesh.size("cp")
        if cp == 1:
            return batch
        return map_tensors(lambda t: shard_sequence(t, cp, self.mesh.coordinate("cp"), dim), batch)

    @watched("train_step")
    def train_step(self, batch: Any) -> torch.Tensor:
        """Forward, backward and (on syncing micro-steps) clip, optimizer and scheduler step; returns the loss."""
        model = self._only("model", self._models)
        optimizer = self._only("optimizer", self._optimizers)
        causal = self.loss_fn is None and self._causal_lm and is_causal_lm_batch(batch)
        if causal:  # labels shifted before any sequence split; the loss is the mean over the step's tokens
            batch = split_causal_lm_batch(batch)
        if self.mesh.size("cp") > 1:
            batch = self.shard_sequence(batch)
        with self.accumulate():
            if self._pipeline is not None:
                with self.loss_parallel():
                    loss = self._pipeline.step(*pipeline_pair(batch, causal), self.mesh.grad_group)
                self._gradients.reduce_after_schedule()
            elif causal:
                inputs, targets = batch
                with self.loss_parallel():
                    total = token_loss_sum(logits_of(model(**inputs)), targets)
                count = (targets != IGNORE_INDEX).sum()
                # the step's loss sum and token count over every rank, summed while backward runs
                summed = collectives.start_sum(torch.stack((total.detach().float(), count.float())), self._grad_group)
                self._gradients.backward(total / count.clamp(min=1), count, global_items=lambda: float(summed()[1]))
                loss = summed()[0] / summed()[1].clamp(min=1)
            else:
                with self.loss_parallel():
                    loss = compute_loss(model, batch, self.loss_fn)
                self.backward(loss)
            if self.sync_gradients and self.config.max_grad_norm is not None:
                self.clip_grad_norm_(self.config.max_grad_norm)
            optimizer.step()
            for scheduler in self._schedulers:
                scheduler.step()
            optimizer.zero_grad()
        loss = loss.detach()
        return loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss parallel: a replicated DTensor

    # ------------------------------------------------------------------ end
    def end(self, *, wait_for_peers: bool = True) -> None:
        """Close the trackers and leave the process group (if this engine created it). Safe to call twice.

        With `wait_for_peers` every rank first meets the others at a barrier, so no rank tears its
        communicator down while a peer is still talking to it; pass False on an error path, where a peer
        may be gone.
        """
        if wait_for_peers:
            self._close_checkpointer()
            self.end_training()  # trackers close; a parameter-server worker tells the servers it is done
        self._preemption.disarm()
        if self._doctor is not None:
            self._doctor.stop()
            self._doctor = None
        self._close_trackers()  # (already closed above, unless this is an error path)
        # (a parameter-server run ends when the servers have heard every worker finish; a lost worker misses a barrier)
        peers = dist.is_initialized() and dist.get_world_size() > 1
        if wait_for_peers and self._ps is None and self._owns_process_group and peers:
            dist.barrier()
        self._stop_process_group()

    def _stop_process_group(self) -> None:
        if self._owns_process_group and dist.is_initialized():
            gc.collect()  # drop finished work handles (and their tensors) before the communicator goes
            dist.destroy_process_group()
        self._owns_process_group = False

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # A preemption stop is agreed by every rank: they leave together, as after a normal end.
        self.end(wait_for_peers=exc_type is None or issubclass(exc_type, Preempted))
