"""`meshkit.Accelerator`: Accelerate's name, constructor and semantics over a meshkit Engine it holds, so a script
written against `accelerate.Accelerator` runs by changing only the import:

    from meshkit import Accelerator, DataLoaderConfiguration, DistributedType, ProjectConfiguration

Every public member of `accelerate.Accelerator` is here with Accelerate's argument order and behaviour (a test
enumerates the installed Accelerate's), or refuses at the call in one line naming what to do instead. Where the two
libraries name the same verb differently, this class carries Accelerate's meaning (`save_model(model, dir)`,
`reduce(tensor, reduction="sum")`, a scheduler stepped once per process); the Engine keeps its own (it is not
a subclass: each name means one thing on each).
Arguments are read as `accelerate_arguments` says (arguments.py); the run facts come from the mesh (state.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from meshkit.compat.accelerate import saving
from meshkit.compat.accelerate.arguments import AcceleratorError, accelerate_arguments
from meshkit.compat.accelerate.facts import _EVEN, AcceleratorFacts
from meshkit.compat.accelerate.handlers import (  # noqa: F401 - re-exported (meshkit.Accelerator's companions)
    DistributedDataParallelKwargs,
    DistributedType,
    InitProcessGroupKwargs,
)
from meshkit.compat.accelerate.loop_verbs import AccelerateLoopVerbs
from meshkit.compat.accelerate.process_logging import share_process_facts
from meshkit.compat.accelerate.profiling import profiled
from meshkit.compat.accelerate.sync import SyncControl
from meshkit.compat.accelerate.verbs import AccelerateVerbs
from meshkit.data.loader import rebuilt
from meshkit.engine.delegation import Attribute, Verb
from meshkit.engine.engine import Engine
from meshkit.runtime import collectives
from meshkit.training.accumulation import GradientState, PreparedScheduler
from meshkit.training.precision import make_grad_scaler

_ACCELERATE_NAMES = frozenset((accelerate_arguments.__kwdefaults__ or {}).keys())


class Accelerator(AcceleratorFacts):
    """Accelerate's `Accelerator` over a meshkit `Engine` (`accelerator.engine`): Accelerate's constructor arguments,
    members and meanings. meshkit's own verbs are the engine's (`accelerator.engine.train_step(batch)`)."""

    # ------------------------------------------------------------------ the Engine's, where Accelerate means the same
    process_index = Attribute[int]("engine", Engine)
    num_processes = Attribute[int]("engine", Engine)
    is_main_process = Attribute[bool]("engine", Engine)
    is_local_main_process = Attribute[bool]("engine", Engine)
    sync_gradients = Attribute[bool]("engine", Engine)
    gradient_state = Attribute[GradientState]("engine", Engine)
    scaler = Attribute[Any]("engine", Engine)
    gather = Verb("engine", Engine.gather)
    wait_for_everyone = Verb("engine", Engine.wait_for_everyone)
    main_process_first = Verb("engine", Engine.main_process_first)
    print = Verb("engine", Engine.print)
    accumulate = Verb("engine", Engine.accumulate)
    clip_grad_norm_ = Verb("engine", Engine.clip_grad_norm_)
    register_for_checkpointing = Verb("engine", Engine.register_for_checkpointing)
    # ------------------------------------------------------------------ Accelerate's own (verbs.py, loop_verbs.py)
    local_process_index = Attribute[int]("accelerate_verbs", AccelerateVerbs)
    is_last_process = Attribute[bool]("accelerate_verbs", AccelerateVerbs)
    mixed_precision = Attribute[str]("accelerate_verbs", AccelerateVerbs)
    on_main_process = Verb("accelerate_verbs", AccelerateVerbs.on_main_process)
    on_local_main_process = Verb("accelerate_verbs", AccelerateVerbs.on_local_main_process)
    on_last_process = Verb("accelerate_verbs", AccelerateVerbs.on_last_process)
    on_process = Verb("accelerate_verbs", AccelerateVerbs.on_process)
    split_between_processes = Verb("accelerate_verbs", AccelerateVerbs.split_between_processes)
    skip_first_batches = Verb("accelerate_verbs", AccelerateVerbs.skip_first_batches)
    use_distributed = Attribute[bool]("accelerate_loop_verbs", AccelerateLoopVerbs)
    pad_across_processes = Verb("accelerate_loop_verbs", AccelerateLoopVerbs.pad_across_processes)
    local_main_process_first = Verb("accelerate_loop_verbs", AccelerateLoopVerbs.local_main_process_first)
    on_local_process = Verb("accelerate_loop_verbs", AccelerateLoopVerbs.on_local_process)
    set_trigger = Verb("accelerate_loop_verbs", AccelerateLoopVerbs.set_trigger)
    check_trigger = Verb("accelerate_loop_verbs", AccelerateLoopVerbs.check_trigger)

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        code, self._settings = accelerate_arguments(**{k: v for k, v in kwargs.items() if k in _ACCELERATE_NAMES})
        self.engine = Engine(config, **code, **{k: v for k, v in kwargs.items() if k not in _ACCELERATE_NAMES})
        self.accelerate_verbs = AccelerateVerbs(self.ctx)
        self.accelerate_loop_verbs = AccelerateLoopVerbs(
            self.ctx, self.prepare, self.engine.processes, self.engine.weights, self.accelerate_verbs
        )
        plugin = self._settings.gradient_accumulation_plugin
        self.ctx.gradient_state.sync_with_dataloader = getattr(plugin, "sync_with_dataloader", True)
        scaler = self._settings.scaler_handler
        if scaler is not None and self.ctx.scaler is not None:
            fields = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
            sharded = self.mesh.grad_group if self.zero_stage else None
            settings = {name: getattr(scaler, name) for name in fields}
            self.ctx.scaler = make_grad_scaler(self.config.precision, self.device, sharded, **settings)
        self._hooks = saving.StateHooks()
        self._sync = SyncControl(self.ctx)
        self._said: set[str] = set()
        for line in self._settings.notices:
            self._notice(line)
        share_process_facts(self)  # (accelerate.logging's logger reads Accelerate's own state)

    def init_trackers(
        self,
        project_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Accelerate's name of the Engine's `start_trackers`."""
        self.engine.start_trackers(project_name, config, init_kwargs)

    def _notice(self, line: str) -> None:
        """One line on the main process, once per run: a setting that changes nothing here."""
        if line not in self._said:
            self._said.add(line)
            if self.is_main_process:
                print(f"meshkit: {line}", flush=True)

    # ------------------------------------------------------------------ the engine underneath
    def end(self, *, wait_for_peers: bool = True) -> None:
        """The engine's `end()`: trackers close and the process group ends (safe to call twice)."""
        self.engine.end(wait_for_peers=wait_for_peers)

    def __enter__(self) -> Accelerator:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.engine.__exit__(exc_type, *exc)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None, loss_fn: Any = None) -> Any:
        """As Accelerate's: with `split_batches` a loader's batch is the global one (divided over the processes);
        a scheduler steps once per process at each optimizer step (unless split_batches), as Accelerate's does."""
        objects = tuple(self._split(obj) if isinstance(obj, DataLoader) else obj for obj in args)
        prepared = self.engine.prepare(*objects, loss_fn=loss_fn)
        steps = 1 if self.split_batches else self.dp_size
        for scheduler in self.ctx.objects.schedulers:
            if isinstance(scheduler, PreparedScheduler):
                scheduler.steps_per_step = steps
                scheduler.with_optimizer = self.step_scheduler_with_optimizer
        return prepared

    def _split(self, loader: DataLoader) -> DataLoader:
        if not self.split_batches or loader.batch_size is None:
            return loader
        if loader.batch_size % self.dp_size:
            raise AcceleratorError(
                f"split_batches: batch_size {loader.batch_size} does not divide over {self.dp_size} processes; "
                f"use a multiple of {self.dp_size}"
            )
        sampler = {"shuffle": True} if isinstance(loader.sampler, RandomSampler) else {}
        return rebuilt(loader, batch_size=loader.batch_size // self.dp_size, drop_last=loader.drop_last, **sampler)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: Any, device_placement: bool | None = None) -> Any:
        return self.prepare(optimizer)

    def prepare_data_loader(
        self, data_loader: Any, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ):
        return self.prepare(data_loader)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.engine.backward(loss, **kwargs)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Backward inside the block accumulates gradients locally, without reducing them."""
        return self._sync.hold(model, sync=False)

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Backward inside the block reduces gradients, also inside `no_sync` or a non-syncing micro-step."""
        return self._sync.hold(model, sync=True)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Any, even_batches: bool | None = None) -> Iterator[Any]:
        """Prepared loaders give every rank the same number of batches, so no rank runs out early."""
        if even_batches is False or not self.even_batches:
            self._notice(_EVEN)
        yield joinables

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Under fp16, divide the gradients by the loss scale now (clip_grad_* and step do not do it twice)."""
        chosen = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer is not None else None
        self.engine._gradients.unscale_gradients(None if chosen is None else list(chosen))

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every prepared model's gradients to ±clip_value (any layout: the clamp is elementwise)."""
        self.engine._gradients.clip_grad_value_(float(clip_value))

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        raise AcceleratorError(
            "lomo_backward: LOMO optimizers are not supported; use a torch optimizer (and zero_stage) instead"
        )

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        raise AcceleratorError("deepspeed_ulysses_dl_adapter: split sequences with cp_size (ring attention) instead")

    def free_memory(self, *objects: Any) -> list[None]:
        self.step = 0
        return self.accelerate_verbs.free_memory(*objects)

    def clear(self, *objects: Any) -> list[None]:
        return self.free_memory(*objects)

    def end_training(self) -> None:
        """Trackers close and the process group ends, as with Accelerate (the last call of a script)."""
        self.end()

    # ------------------------------------------------------------------ metrics and logs
    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce over the processes that hold different data: 'sum' (Accelerate's default), 'mean', 'max'
        or 'none' (a sum, as Accelerate's). `scale` applies on XLA only in Accelerate: ignored, as there."""
        if reduction not in ("sum", "mean", "max", "none"):
            raise AcceleratorError(f"reduce(reduction={reduction!r}): choose 'sum', 'mean', 'max' or 'none'")
        op = "sum" if reduction == "none" else reduction
        return collectives.reduce(tensor, self.ctx.placement.metric_group, op=op)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return self.engine.gather_for_metrics(input_data)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        if log_kwargs:
            self._notice("log(log_kwargs=...): meshkit's trackers take the values and the step only")
        self.engine.log(values, self.ctx.objects.step if step is None else step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        tracker = self.accelerate_verbs.get_tracker(name)
        if not unwrap or tracker is None:
            return tracker
        return getattr(tracker, "run", None) or getattr(tracker, "writer", None) or tracker

    # ------------------------------------------------------------------ contexts
    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        handler = autocast_handler or self.autocast_handler
        if handler is not None and not getattr(handler, "enabled", True):
            return torch.autocast(self.device.type, enabled=False)
        return self.accelerate_loop_verbs.autocast()

    def profile(self, profile_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        """torch.profiler around the block, set by ProfileKwargs; with output_trace_dir each process writes
        `profile_<process index>.json` there (a Chrome trace)."""
        return profiled(profile_handler or self.profile_handler, self.process_index, self.wait_for_everyone)

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: Any = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Under cp, each buffer holds this rank's sequence chunks inside the block (restored after, unless in
        `no_restore_buffers`); without cp it changes nothing."""
        if self.mesh.size("cp") == 1:
            self._notice("maybe_context_parallel: cp is 1, the buffers stay whole")
            return contextlib.nullcontext()
        return self._sync.sequence_chunks(buffers or [], buffer_seq_dims or [], no_restore_buffers or set())

    def verify_device_map(self, model: nn.Module) -> bool:
        """True when the model was spread over devices by a `device_map` (it cannot then be prepared)."""
        return any(len(getattr(module, "hf_device_map", {}) or {}) > 1 for module in model.modules())

    # ------------------------------------------------------------------ weights and states
    def unwrap_model(
        self, model: nn.Module | None = None, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ):
        return self.engine.unwrap_model(model)

    def get_state_dict(self, model: nn.Module | None = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full weights under the user's names (collective under sharding: every rank calls it)."""
        return self.engine.full_state_dict(model if model in self.ctx.objects.models else None)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Write `obj` on the main process (each node's with ProjectConfiguration(save_on_each_node=True)):
        safetensors with `safe_serialization`, else torch.save. The file appears complete or not at all."""
        per_node = self.project_configuration.save_on_each_node
        if self.is_local_main_process if per_node else self.is_main_process:
            saving.save_object(obj, f, safe_serialization)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | Any,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Accelerate's order: safetensors shards (+ index when sharded) that `from_pretrained` loads."""
        if Path(save_directory).is_file():
            raise AcceleratorError(f"save_model: {save_directory} is a file; pass a directory")
        if not safe_serialization:
            self._notice("save_model(safe_serialization=False): weights are written as safetensors")
        prepared = model if model in self.ctx.objects.models else None
        self.engine.save_model(save_directory, model=prepared, max_shard_size=max_shard_size)

    def register_save_state_pre_hook(self, hook: Any) -> Any:
        """`hook(models, weights, output_dir)` runs at each save_state; files it writes into output_dir are kept
        there (the weights are in the checkpoint whatever it removes from `weights`)."""
        return self._hooks.register(self._hooks.save, hook)

    def register_load_state_pre_hook(self, hook: Any) -> Any:
        """`hook(models, input_dir)` runs at each load_state, before the state is read."""
        return self._hooks.register(self._hooks.load, hook)

    def save_state(self, output_dir: Any = None, safe_serialization: bool = True, **save_model_func_kwargs: Any) -> str:
        """Accelerate's save_state: into `output_dir`, or (automatic naming) `project_dir/checkpoints/checkpoint_<n>`;
        a directory holding an earlier state is written over, as with Accelerate (atomically here)."""
        return saving.save_state(self, self.engine.save_state, output_dir, self._hooks)

    def load_state(
        self, input_dir: Any = None, load_kwargs: Any = None, **load_model_func_kwargs: Any
    ) -> dict[str, Any]:
        """Accelerate's load_state: from `input_dir`, or (automatic naming) the newest checkpoint_<n>."""
        return saving.load_state(self, self.engine.load_state, input_dir, self._hooks)
