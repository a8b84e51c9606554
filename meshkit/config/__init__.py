"""The whole run as frozen, validated sections, and where each value came from.

`schema` holds the sections (`RunConfig` and its parts), `resolve` merges defaults < file < environment < launch
flags < code and keeps every value's source, `importing/` reads Accelerate, DeepSpeed and Axolotl configs. This
package imports nothing above `core/`, so reading a config never imports torch.
"""

from meshkit.config.schema import (
    PARALLEL_DIMS,
    PIPELINE_SCHEDULES,
    PREEMPT_SIGNALS,
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    DDPConfig,
    GPTConfig,
    LaunchSettings,
    LoggingConfig,
    ParallelConfig,
    ParameterServerConfig,
    PipelineConfig,
    ProbeConfig,
    RunConfig,
    ShardingConfig,
    StructureConfig,
    TensorParallelConfig,
    TrainConfig,
    ZeroConfig,
)

__all__ = [
    "PARALLEL_DIMS",
    "PIPELINE_SCHEDULES",
    "PREEMPT_SIGNALS",
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "CompileConfig",
    "DDPConfig",
    "GPTConfig",
    "LaunchSettings",
    "LoggingConfig",
    "ParallelConfig",
    "ParameterServerConfig",
    "PipelineConfig",
    "ProbeConfig",
    "RunConfig",
    "ShardingConfig",
    "StructureConfig",
    "TensorParallelConfig",
    "TrainConfig",
    "ZeroConfig",
]
