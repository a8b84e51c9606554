"""The whole run as frozen, validated settings.

`RunConfig` is the schema; `meshkit.config.resolve.resolve()` layers defaults < YAML file < `MESHKIT_*`
environment < launch flags < code arguments into one `RunConfig` and remembers where each value came from.
Every section is a frozen pydantic model that rejects unknown keys, so a typo never passes silently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from meshkit.config.launch_settings import LaunchSettings
from meshkit.config.model import GPTConfig
from meshkit.config.section import MAX_SECONDS, Section, seconds  # noqa: F401 - MAX_SECONDS re-exported
from meshkit.config.sections import (  # noqa: F401 - re-exported: every section is importable from here
    PIPELINE_SCHEDULES,
    PREEMPT_SIGNALS,
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    DDPConfig,
    ExpertsConfig,
    LoggingConfig,
    ParameterServerConfig,
    PipelineConfig,
    PreemptSignal,
    ProbeConfig,
    ShardingConfig,
    StructureConfig,
    TensorParallelConfig,
    ZeroConfig,
)
from meshkit.config.train import TrainConfig

PARALLEL_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimension names, in the fixed order the device mesh is built with (outermost first)."""


class ParallelConfig(Section):
    """Sizes of the five mesh dimensions; one of them may be -1, meaning "the rest of the world"."""

    dp_replicate: int = Field(-1, description="data-parallel replicas (DDP); -1 = the rest of the world")
    dp_shard: int = Field(
        1, description="data-parallel shard group; without parameter sharding its ranks act as replicas"
    )
    cp: int = Field(1, description="context-parallel size (sequence split across ranks)")
    tp: int = Field(1, description="tensor-parallel size")
    pp: int = Field(1, description="pipeline-parallel stages")
    ep: int = Field(
        1,
        ge=1,
        description="expert-parallel size: the data-parallel (× cp) ranks over which each mixture-of-experts "
        "block's experts are split, tokens routed to them by all-to-all (not a mesh factor of its own)",
    )

    @field_validator(*PARALLEL_DIMS)
    @classmethod
    def _positive_or_rest(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be a positive size, or -1 for 'the rest of the world'")
        return value

    @model_validator(mode="before")
    @classmethod
    def _rest_moves_to_the_named_dim(cls, data: Any) -> Any:
        # dp_replicate defaults to "the rest"; naming another dim as the rest makes dp_replicate 1.
        others_rest = isinstance(data, dict) and any(
            str(data.get(name)) == "-1" for name in PARALLEL_DIMS if name != "dp_replicate"
        )
        if others_rest and "dp_replicate" not in data:
            return {**data, "dp_replicate": 1}
        return data

    @model_validator(mode="after")
    def _one_rest_at_most(self) -> ParallelConfig:
        rest = [name for name in PARALLEL_DIMS if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ValueError(f"only one size may be -1 ('the rest'), got -1 for {', '.join(rest)}: set all but one")
        return self


class RunConfig(Section):
    """Every setting of a run. Build it directly, or let `resolve()` layer the sources for you."""

    parallel: ParallelConfig = ParallelConfig()
    strategy: Literal["auto", "dataparallel", "parameter_server"] = Field(
        "auto",
        description="auto = the layout the parallel sizes give (DDP, ZeRO, tp, pp, cp); dataparallel = one process, "
        "torch.nn.DataParallel over its local GPUs; parameter_server = servers hold the weights (see ps)",
    )
    ps: ParameterServerConfig = ParameterServerConfig()
    layout: Literal["manual", "auto"] = Field(
        "manual",
        description="manual = the parallel sizes as set; auto = the planner's top layouts are probed on the real "
        "ranks (meshkit train, or Engine.prepare) and training goes on in the fastest (see probe)",
    )
    probe: ProbeConfig = ProbeConfig()
    precision: Literal["no", "bf16", "fp16"] = Field("no", description="mixed precision: no (fp32), bf16, fp16")
    grad_accum_steps: int = Field(1, ge=1, description="micro-steps per optimizer step")
    max_grad_norm: float | None = Field(None, gt=0, description="clip gradients to this norm in train_step")
    neftune_noise_alpha: float | None = Field(
        None,
        gt=0,
        description="NEFTune: uniform noise of ±alpha/sqrt(seq·hidden) on the input embeddings while "
        "training (as transformers' Trainer adds it); null = none",
    )
    tiled_mlp: bool = Field(
        False,
        description="run each block's MLP over slices of the sequence under checkpointing: its intermediate "
        "activations exist for one slice at a time (long sequences)",
    )
    tiled_mlp_shards: int | None = Field(
        None,
        ge=1,
        description="tiled_mlp: slices of the sequence; null = ceil(seq / hidden), as Arctic Long "
        "Sequence Training sizes them",
    )
    fused_loss: Literal["auto", "on", "off"] = Field(
        "auto",
        description="train_step's causal-LM loss from the head's input and weight, a chunk of tokens at a time: the "
        "whole logits never exist (cut cross-entropy); auto = where exact (the model returns its head's output as "
        "its logits), on = refuse where not, off = from the logits",
    )
    seed: int = Field(0, ge=0, description="seed for model init, data order and dropout")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu")
    collective_timeout_s: float = seconds(600.0, "timeout of every collective, in seconds")
    hang_doctor: bool = Field(
        True, description="on a stalled collective, name the ranks that never reached it (heartbeats, 1/s)"
    )
    threads_per_process: int | None = Field(
        None,
        ge=1,
        description="torch threads per rank (OMP_NUM_THREADS sets it too); null = the rank's share of its cores",
    )
    blocks: str | None = Field(
        None, description="dotted path of the repeated-block list; null = the longest ModuleList of one class"
    )
    host_memory_slack_mb: float | None = Field(
        16.0,
        ge=0,
        description="CPU ranks: hand freed memory back to the system when resident memory exceeds the most "
        "the first 3 steps held by this much (MB), and start workers on the allocator `host_allocator` names; "
        "null = neither (glibc's malloc keeps freed memory, fragmented)",
    )
    host_allocator: Literal["auto", "tcmalloc", "glibc"] = Field(
        "auto",
        description="CPU workers `meshkit launch` starts: tcmalloc (preloaded; caches freed blocks, so the peak "
        "stays flat without slowing the step), glibc (blocks of 4 MB or more mapped on their own, on huge pages: flat, "
        "but the kernel zeroes each step's fresh blocks), auto = tcmalloc where installed, else glibc",
    )
    structure: StructureConfig = StructureConfig()
    activation_checkpointing: ActivationCheckpointConfig = ActivationCheckpointConfig()
    activation_offload: bool = Field(
        False, description="keep saved activations in (pinned) CPU memory between forward and backward"
    )
    sharding: ShardingConfig = ShardingConfig()
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    moe: ExpertsConfig = ExpertsConfig()
    compile: CompileConfig = CompileConfig()
    ddp: DDPConfig = DDPConfig()
    zero: ZeroConfig = ZeroConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchSettings = LaunchSettings()
    model: GPTConfig = GPTConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="before")
    @classmethod
    def _sharding_takes_the_rest(cls, data: Any) -> Any:
        # With zero_stage >= 1 and no data-parallel size given, every data-parallel rank holds a shard.
        if not isinstance(data, dict):
            return data
        sharding, parallel = data.get("sharding", {}), data.get("parallel", {})
        if isinstance(sharding, BaseModel):
            sharding = sharding.model_dump(exclude_unset=True)
        if isinstance(parallel, BaseModel):
            parallel = parallel.model_dump(exclude_unset=True)
        sharded = str(sharding.get("zero_stage", 0)) in ("1", "2", "3")
        sizes_given = {"dp_replicate", "dp_shard"} & set(parallel)
        rest_elsewhere = any(str(value) == "-1" for value in parallel.values())
        if sharded and not sizes_given and not rest_elsewhere:
            return {**data, "parallel": {**parallel, "dp_replicate": 1, "dp_shard": -1}}
        return data

    @field_validator("precision", mode="before")
    @classmethod
    def _yaml_no_is_false(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `no` as False; `precision: no` means fp32.
        if value is False:
            return "no"
        if isinstance(value, str) and value.lower() in ("fp32", "float32", "none"):
            return "no"
        return value
