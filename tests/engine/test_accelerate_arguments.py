"""Accelerate's constructor arguments, handlers and plugins as meshkit settings (read by their fields, so
Accelerate's own objects map the same as meshkit's records); fp8 and Megatron-LM refused in one line."""

from __future__ import annotations

import pytest

from meshkit import (
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ParallelismConfig,
    ProfileKwargs,
)
from meshkit.compat.accelerate.arguments import AcceleratorError, accelerate_arguments


def test_the_common_arguments_map_to_meshkit_settings() -> None:
    class Plugin:  # Accelerate's TorchDynamoPlugin, read by its fields
        backend, mode, fullgraph, dynamic, disable = "INDUCTOR", "max-autotune", False, None, False

    code, kept = accelerate_arguments(
        mixed_precision="BF16", log_with=["tensorboard", "wandb"], dynamo_plugin=Plugin(), cpu=True, project_dir="p"
    )
    assert code == {
        "precision": "bf16",
        "logging": {"trackers": ["jsonl", "tensorboard", "wandb"], "dir": "p"},
        "compile": {"enabled": True, "backend": "inductor", "mode": "max-autotune", "fullgraph": False},
        "device": "cpu",
    }
    assert kept.project_configuration.project_dir == kept.project_configuration.logging_dir == "p"
    assert kept.log_with == ["tensorboard", "wandb"] and kept.notices == []


def test_handlers_and_plugins() -> None:
    ddp = DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType.POWER_SGD, comm_state_option={"matrix_approximation_rank": 2}
    )
    profile = ProfileKwargs(activities=["cpu"])
    code, kept = accelerate_arguments(
        kwargs_handlers=[ddp, profile],
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False),
        fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP", activation_checkpointing=True),
    )
    assert code["ddp"]["comm_hook"] == "power_sgd" and code["ddp"]["comm_state"] == {"matrix_approximation_rank": 2}
    assert code["grad_accum_steps"] == 4 and kept.profile_handler is profile
    assert code["sharding"]["zero_stage"] == 2 and code["activation_checkpointing"]["mode"] == "full"
    code, _ = accelerate_arguments(
        deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0, offload_param_device="cpu")
    )
    assert code["sharding"] == {"zero_stage": 3, "offload": "cpu"} and code["max_grad_norm"] == 1.0
    ds_config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}
    code, _ = accelerate_arguments(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
    assert code["sharding"]["zero_stage"] == 2 and code["max_grad_norm"] == 0.5
    code, _ = accelerate_arguments(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    assert (
        code["parallel"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1} and code["sharding"]["zero_stage"] == 3
    )


def test_settings_without_effect_are_one_notice_each_and_missing_features_refuse() -> None:
    _, kept = accelerate_arguments(dataloader_config=DataLoaderConfiguration(dispatch_batches=True, non_blocking=True))
    assert len(kept.notices) == 2 and all("\n" not in line for line in kept.notices)

    class FP8RecipeKwargs:  # Accelerate's fp8 handler, by its name
        pass

    for arguments, message in (
        ({"mixed_precision": "fp8"}, "use 'bf16'"),
        ({"kwargs_handlers": [FP8RecipeKwargs()]}, "fp8 training"),
        ({"megatron_lm_plugin": object()}, "parallelism_config"),
        ({"log_with": "comet_ml"}, "jsonl, tensorboard and wandb"),
        ({"kwargs_handlers": [object()]}, "object is not taken"),
        ({"parallelism_config": ParallelismConfig(sp_size=2)}, "set cp_size"),
    ):
        with pytest.raises(AcceleratorError, match=message) as error:
            accelerate_arguments(**arguments)
        assert "\n" not in str(error.value)
