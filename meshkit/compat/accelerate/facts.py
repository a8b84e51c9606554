"""What `meshkit.Accelerator` answers about its run, as Accelerate's members do: the engine underneath, the kind of
run and its parallel ranks, and what the Accelerator was built with (its constructor's settings). The verbs are in
accelerator.py; this class holds the facts only and reads them from the Engine and the settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from meshkit.compat.accelerate import state
from meshkit.compat.accelerate.arguments import AcceleratorError
from meshkit.compat.accelerate.handlers import DistributedType
from meshkit.config.schema import RunConfig
from meshkit.engine.context import EngineContext
from meshkit.engine.engine import Engine
from meshkit.runtime.mesh import ParallelMesh

if TYPE_CHECKING:
    from meshkit.compat.accelerate.loop_verbs import AccelerateLoopVerbs


class AcceleratorFacts:
    """The read-only (and Accelerate's settable) facts of an Accelerator; `engine`, `_settings` and the verbs'
    components are set by `Accelerator.__init__`."""

    engine: Engine
    _settings: Any
    accelerate_loop_verbs: AccelerateLoopVerbs
    num_processes: int
    use_distributed: bool
    mixed_precision: str

    def _notice(self, line: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the engine underneath
    @property
    def ctx(self) -> EngineContext:
        """The engine's shared context (what Accelerate's verbs read)."""
        return self.engine.ctx

    @property
    def config(self) -> RunConfig:
        return self.engine.config

    @property
    def mesh(self) -> ParallelMesh:
        return self.engine.mesh

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_stage

    @property
    def dp_size(self) -> int:
        return self.engine.dp_size

    # ------------------------------------------------------------------ what kind of run
    @property
    def distributed_type(self) -> DistributedType:
        return state.distributed_type(self.num_processes, self.device, self.zero_stage)

    @property
    def state(self) -> state.AcceleratorState:
        return state.AcceleratorState(self)

    @property
    def multi_device(self) -> bool:
        return self.use_distributed and self.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.NO)

    @property
    def native_amp(self) -> bool:
        return self.mixed_precision in ("fp16", "bf16")

    @property
    def is_fsdp2(self) -> bool:
        return self.zero_stage == 3

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def parallelism_config(self) -> Any:
        return state.parallelism_config(self)

    @property
    def torch_device_mesh(self) -> Any:
        return self.mesh.device_mesh

    @property
    def should_save_model(self) -> bool:
        return True  # every rank takes part in save_model; the main process writes

    @property
    def tensor_parallel_rank(self) -> int:
        return self.mesh.coordinate("tp")

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.mesh.coordinate("pp")

    @property
    def context_parallel_rank(self) -> int:
        return self.mesh.coordinate("cp")

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.coordinate("dp_replicate")

    @property
    def data_parallel_shard_rank(self) -> int:
        return self.mesh.coordinate("dp_shard")

    # ------------------------------------------------------------------ what it was built with
    dataloader_config = property(lambda self: self._settings.dataloader_config)
    project_configuration = property(lambda self: self._settings.project_configuration)
    init_handler = property(lambda self: self._settings.init_handler)
    ddp_handler = property(lambda self: self._settings.ddp_handler)
    profile_handler = property(lambda self: self._settings.profile_handler)
    autocast_handler = property(lambda self: self._settings.autocast_handler)
    scaler_handler = property(lambda self: self._settings.scaler_handler)
    deepspeed_plugin = property(lambda self: None)  # (a DeepSpeedPlugin's settings are meshkit's ZeRO now)
    fsdp_plugin = property(lambda self: self._settings.fsdp_plugin)
    step_scheduler_with_optimizer = property(lambda self: self._settings.step_scheduler_with_optimizer)
    device_placement = property(lambda self: self._settings.device_placement)
    rng_types = property(lambda self: self._settings.rng_types)
    log_with = property(lambda self: self._settings.log_with)
    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)
    project_dir = property(lambda self: self.project_configuration.project_dir)
    logging_dir = property(lambda self: self.project_configuration.logging_dir)
    save_iteration = property(lambda self: self.project_configuration.iteration)
    # fp8 is refused at construction: none of these is ever set
    fp8_recipe_handler = te_recipe_handler = ao_recipe_handler = msamp_recipe_handler = property(lambda self: None)
    has_fp8_handler = fp8_enabled = delayed_fp8_autocast = has_lomo_optimizer = property(lambda self: False)
    fp8_backend = property(lambda self: "NO")

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value
        if not value:
            self._notice(_EVEN)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.ctx.gradient_state.accum_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        """Set for the next micro-steps, as Accelerate allows (e.g. after find_executable_batch_size shrank the
        batch)."""
        if int(steps) < 1:
            raise AcceleratorError(f"gradient_accumulation_steps = {steps}: give 1 or more")
        self.ctx.gradient_state.accum_steps = int(steps)

    @property
    def trackers(self) -> list[Any]:
        return self.ctx.trackers.running

    @property
    def step(self) -> int:
        """Accelerate's counter: micro-steps taken by `accumulate` in this window sequence (0 at each epoch end)."""
        return self.ctx.gradient_state.micro_step

    @step.setter
    def step(self, value: int) -> None:
        self.ctx.gradient_state.micro_step = value

    @property
    def flag_tensor(self) -> torch.Tensor | None:
        raised = self.accelerate_loop_verbs._trigger_raised
        return torch.tensor(1, device=self.device) if raised else None

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(optimizer.step_was_skipped for optimizer in self.ctx.objects.optimizers)


_EVEN = (
    "even_batches=False: prepared loaders give every rank the same number of batches (the last padded); "
    "gather_for_metrics drops the repeats, so metrics see each sample once"
)
