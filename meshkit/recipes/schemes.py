"""The fine-tune's step schemes in one place: what each needs of the layout (`refusal`), the one `before_step`
hook the loop calls (QAT's late start, LISA's draws, ReLoRA's restarts) and EAFT's token weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from meshkit.engine.engine import Engine
from meshkit.recipes.loop import chained_hooks
from meshkit.training.token_weights import entropy_weights
from meshkit.tuning import relora
from meshkit.tuning.lisa import LayerSampling
from meshkit.tuning.qat import fake_quant_switch
from meshkit.tuning.relora import PruneMethod


def refusal(zero: int, tp: int, settings: Any) -> str | None:
    """Why LISA or ReLoRA cannot run as asked in this layout (one line), or None."""
    supervised = settings.rl is None and not settings.reward_model and not settings.process_reward_model
    if (settings.samples_layers or settings.relora or settings.use_eaft) and not supervised:
        return (
            "LISA, ReLoRA and EAFT run with supervised fine-tuning here: drop the lisa / relora / eaft keys or rl / "
            "reward_model"
        )
    if settings.samples_layers:
        if settings.adapter is not None:
            return "LISA samples the blocks of a full fine-tune: drop adapter (or the lisa keys)"
        if zero in (1, 2):
            return (
                f"LISA leaves resting blocks out of each step, which zero_stage {zero} steps as flat chunks of many "
                "parameters: use zero_stage 0 or 3"
            )
    if settings.relora:
        return relora.refusal(settings.adapter, zero, tp, settings.quantization is not None, settings.peft_use_dora)
    return None


def weigh_tokens(engine: Engine, settings: Any) -> None:
    """EAFT (`use_eaft`): the causal-LM loss weighs each token by its top-k entropy (after `engine.prepare`)."""
    if settings.use_eaft:
        engine.weigh_token_losses(entropy_weights(settings.eaft_alpha, settings.eaft_k))
        engine.print(
            f"meshkit: EAFT: each token's loss weighted by the entropy of its top {settings.eaft_k} next tokens ** "
            f"{settings.eaft_alpha} (training loss; evaluation reports the plain loss)"
        )


def before_step_hook(engine: Engine, settings: Any, model: nn.Module) -> Callable[[int], None] | None:
    """The loop's hook for `model` (before `engine.prepare`; the schemes act on the prepared one). Says what it
    runs, one line each."""
    quantization_switch = fake_quant_switch(model, settings.qat) if settings.qat is not None else None
    sampling = None
    if settings.samples_layers:
        sampling = LayerSampling.of(
            engine, model, settings.lisa_layers_attribute, settings.lisa_n_layers, settings.lisa_step_interval
        )
        engine.print(f"meshkit: {sampling.describe()}")
    restarts = None
    if settings.relora:
        method: PruneMethod = settings.relora_prune_method or "magnitude"
        restarts = relora.AdapterRestarts(engine, settings.jagged_restart_steps, method, settings.prune_ratio)
        engine.print(
            f"meshkit: ReLoRA: adapters merged into the base and restarted every {settings.jagged_restart_steps} "
            f"steps, their Adam moments pruned ({method}, {settings.prune_ratio:.1%}); the output is merged/"
        )
    return chained_hooks(
        quantization_switch,
        sampling.before_step if sampling is not None else None,
        restarts.before_step if restarts is not None else None,
    )
