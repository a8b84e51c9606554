"""The config sections a strategy reads: compile, DDP, ZeRO, activation checkpointing, logging, sharding,
tensor and pipeline parallel, checkpoints, the model-structure override, the parameter server, the layout
probe and experts (`RunConfig` in `schema.py` holds them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from meshkit.config.section import Section
from meshkit.config.yaml_text import load_yaml

PreemptSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "none"]
PREEMPT_SIGNALS: tuple[str, ...] = get_args(PreemptSignal)


class CompileConfig(Section):
    """torch.compile of the whole model, or of each repeated block ("regional")."""

    enabled: bool = Field(False, description="compile the model with torch.compile")
    backend: str = Field("inductor", description="torch.compile backend (inductor, aot_eager, eager, ...)")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode"
    )
    fullgraph: bool = Field(False, description="fail on graph breaks instead of falling back to eager")
    dynamic: bool | None = Field(None, description="dynamic shapes: true, false or null (auto)")
    regional: bool | None = Field(
        None,
        description="compile each repeated block instead of the whole model; null = as the layout needs: per block "
        "where sharding hooks sit in the model (zero_stage 3, tp, pipeline stages), the whole model otherwise",
    )


class DDPConfig(Section):
    """DistributedDataParallel options (communication/computation overlap)."""

    bucket_cap_mb: float = Field(25.0, gt=0, description="gradient bucket size for the all-reduce overlap")
    gradient_as_bucket_view: bool = Field(False, description="gradients alias the buckets (saves one copy)")
    static_graph: bool = Field(False, description="the graph is the same every step (enables more overlap)")
    find_unused_parameters: bool = Field(False, description="allow parameters without gradient in a step")
    broadcast_buffers: bool = Field(True, description="broadcast buffers from rank 0 every forward")
    comm_hook: Literal["none", "fp16", "bf16", "power_sgd", "batched_power_sgd"] = Field(
        "none", description="torch's DDP communication hook: compress gradients to fp16/bf16, or PowerSGD"
    )
    comm_wrapper: Literal["none", "fp16", "bf16"] = Field(
        "none", description="compress what a PowerSGD hook sends to fp16/bf16"
    )
    comm_state: dict[str, Any] = Field(
        default_factory=dict, description="PowerSGD's settings (matrix_approximation_rank, start_powerSGD_iter, ...)"
    )


class ZeroConfig(Section):
    """ZeRO-1/2 gradient reduction: buckets reduced while backward goes on."""

    bucket_mb: float = Field(25.0, gt=0, description="zero_stage 1/2: gradient bucket (MB) reduced during backward")
    reduce_every_micro_step: bool | None = Field(
        None,
        description="with accumulation: true = reduce each micro-step into the gradient shard (least memory, "
        "accum× traffic); false = keep full gradients until the last (once); null = true for stage 2, false for 1",
    )


class ActivationCheckpointConfig(Section):
    """Recompute activations in backward instead of keeping them (`meshkit.parallel.activation`)."""

    mode: Literal["none", "full", "selective"] = Field(
        "none", description="none | full (recompute whole blocks) | selective (keep matmul outputs, recompute the rest)"
    )
    every: int = Field(1, description="checkpoint every k-th block (1 = all blocks)")

    @field_validator("every")
    @classmethod
    def _every_positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"every={value}: must be >= 1 (1 checkpoints every block, 2 every second block, ...)")
        return value


class LoggingConfig(Section):
    """Where the run writes, and which trackers receive `engine.log()`."""

    dir: Path = Field(Path("runs/default"), description="run directory: metrics, summary, plots")
    trackers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = Field(
        ("jsonl",),
        description="trackers fed by engine.log (jsonl always works; tensorboard and wandb need their extra)",
    )

    @field_validator("trackers", mode="before")
    @classmethod
    def _split_comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return value


class ShardingConfig(Section):
    """Sharded data parallel by the names people know: ZeRO stages, FSDP/HSDP, offload."""

    zero_stage: int = Field(
        0, ge=0, le=3, description="0 = DDP; 1 = shard optimizer states; 2 = and gradients; 3 = and parameters (FSDP)"
    )
    offload: Literal["none", "cpu", "nvme"] = Field(
        "none", description="cpu: FSDP CPU offload (zero_stage 3); nvme: optimizer states in files under offload_dir"
    )
    offload_dir: Path | None = Field(None, description="directory for nvme offload (a fast local disk)")
    reshard_after_forward: bool | None = Field(
        None, description="zero_stage 3: free gathered parameters after forward; null = yes except the last block"
    )
    param_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="zero_stage 3: dtype of gathered parameters; null = from precision"
    )
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="zero_stage 3: dtype of the gradient reduce-scatter; null = fp32"
    )
    unit_mb: float = Field(
        25.0,
        ge=0,
        description="zero_stage 3: consecutive blocks share one FSDP unit (one all-gather, one reduce-scatter) "
        "up to this many MB of parameters; a bigger block is a unit of its own; 0 = one unit per block",
    )
    ring_collectives: bool = Field(
        True,
        description="zero_stage 3 on CPU: FSDP's all-gather and reduce-scatter as rings of point-to-point sends, "
        "in place (gloo's own copy every part, and reduce by all-reduce); false = the backend's own",
    )
    forward_prefetch: int = Field(
        0, ge=0, description="zero_stage 3: units whose all-gather is issued ahead in forward; 0 = torch's default"
    )
    backward_prefetch: int = Field(
        0, ge=0, description="zero_stage 3: units whose all-gather is issued ahead in backward; 0 = torch's default"
    )
    init_from: Path | None = Field(
        None, description="safetensors file or index.json to fill a meta-device model from; null = the model's init"
    )

    @model_validator(mode="after")
    def _supported_combination(self) -> ShardingConfig:
        if self.offload == "nvme" and self.offload_dir is None:
            raise ValueError("offload=nvme needs offload_dir: a directory on a fast local disk")
        if self.offload == "cpu" and self.zero_stage != 3:
            raise ValueError(
                f"offload=cpu is supported with zero_stage=3 (FSDP), not {self.zero_stage}: set zero_stage=3"
            )
        if self.zero_stage != 3:
            for name in ("param_dtype", "reduce_dtype", "reshard_after_forward"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to zero_stage=3 (FSDP) only; use precision= for autocast")
            for name in ("forward_prefetch", "backward_prefetch"):
                if getattr(self, name):
                    raise ValueError(f"{name} applies to zero_stage=3 (FSDP) only; DDP overlaps via ddp.bucket_cap_mb")
        return self


class TensorParallelConfig(Section):
    """How layers are split over the `tp` ranks (Megatron column/row parallel on DTensor)."""

    sequence_parallel: bool = Field(False, description="shard norms on the sequence dim between TP regions")
    loss_parallel: bool = Field(True, description="cross-entropy on vocab-sharded logits, never gathered")
    plan: dict[str, Literal["colwise", "rowwise", "sequence", "replicate"]] | None = Field(
        None, description="module-name patterns -> colwise|rowwise|sequence|replicate; null = built in or automatic"
    )

    @field_validator("plan", mode="before")
    @classmethod
    def _plan_from_text(cls, value: Any) -> Any:
        return load_yaml(value) if isinstance(value, str) else value


PipelineSchedule = Literal[
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"
]
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)


class PipelineConfig(Section):
    """Pipeline parallel: the schedule and how each step's batch is cut into micro-batches."""

    schedule: PipelineSchedule = Field("1f1b", description="|".join(PIPELINE_SCHEDULES))
    microbatches: int | None = Field(None, ge=1, description="micro-batches per step; null = pp size")
    stages_per_rank: int | None = Field(
        None, ge=1, description="model chunks per rank; null = 1, or 2 for interleaved and zero-bubble schedules"
    )


class CheckpointConfig(Section):
    """Periodic, resumable checkpoints (`engine.save_checkpoint()`, `meshkit train`)."""

    dir: Path | None = Field(None, description="checkpoint root; null = <logging.dir>/checkpoints")
    every_steps: int = Field(0, ge=0, description="save every N optimizer steps (0 = never automatically)")
    keep_last: int = Field(3, ge=1, description="committed checkpoints kept; older ones are deleted")
    async_save: bool = Field(
        False, description="write in the background (config key `async` works too); training waits for the copy"
    )
    resume: str = Field(
        "never", description="never | auto (newest good checkpoint under dir, if any) | PATH of a checkpoint"
    )
    preempt_signal: PreemptSignal = Field(
        "SIGTERM",
        description="signal that makes every rank checkpoint at the next save_checkpoint() and exit 75; none = off",
    )


class StructureConfig(Section):
    """What meshkit cannot infer about a model (it recognises transformers models, the reference GPT, and any
    model whose blocks sit in a ModuleList or Sequential)."""

    first_stage: list[str] | None = Field(
        None, description="modules only the first pipeline stage holds, e.g. [embed]; the model skips them when None"
    )
    last_stage: list[str] | None = Field(
        None, description="modules only the last pipeline stage holds, e.g. [norm, head]; skipped when None"
    )
    position_argument: str | None = Field(
        None, description="forward argument that takes token positions (context parallel passes global ones)"
    )


class ParameterServerConfig(Section):
    """`strategy: parameter_server`: ranks 0..servers-1 hold the parameters, the other ranks are workers."""

    servers: int = Field(1, ge=1, description="ranks that hold the parameters (sharded across them by size)")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync = every step waits for every worker (the weights of DDP); async = workers run ahead"
    )
    max_staleness: int | None = Field(
        None, ge=0, description="async: steps a worker may run ahead of the slowest; null = unbounded (Downpour)"
    )
    staleness_lr: bool = Field(False, description="async: scale each gradient by 1/(1 + its staleness)")

    @model_validator(mode="after")
    def _async_only_settings(self) -> ParameterServerConfig:
        if self.mode == "sync" and (self.max_staleness is not None or self.staleness_lr):
            raise ValueError("max_staleness and staleness_lr apply to mode=async (sync never runs ahead)")
        return self


class ProbeConfig(Section):
    """`layout: auto`: how the planner's candidate layouts are tried on the real ranks."""

    top_k: int = Field(4, ge=1, description="candidate layouts tried, the planner's fastest first")
    steps: int = Field(3, ge=1, description="measured optimizer steps per candidate (after one warm-up step)")
    memory_limit_gb: float | None = Field(
        None, gt=0, description="drop a candidate whose per-rank peak exceeds this; null = 90 % of device memory"
    )


class ExpertsConfig(Section):
    """Mixture-of-experts models (the router's load-balancing loss, when the model's config turns it on)."""

    router_aux_loss: Literal["micro_batch", "global_batch"] = Field(
        "micro_batch",
        description="train_step's balancing loss: micro_batch = as the model defines it, on each micro-batch "
        "(over its cp ranks under context parallel); global_batch = its token fractions over every "
        "data-parallel (× cp) rank's tokens of the micro-step (with grad_accum_steps=1, equal to one process on "
        "the global batch)",
    )
    capacity_factor: float | None = Field(
        None,
        gt=0,
        description="under parallel.ep: each expert takes at most capacity_factor × (its even share of a rank's "
        "routed tokens) from that rank, the rest dropped (their expert output is zero); null = dropless",
    )
