"""The step-recipe options `meshkit estimate` and `meshkit plan` share: what the memory of a step depends on
beyond the model and the layout (`meshkit.planning.step_recipe`)."""

from __future__ import annotations

from typing import Annotated, Optional, cast, get_args

import typer

from meshkit.planning.estimate import EstimateError
from meshkit.planning.step_recipe import LossKind, OptimizerStep, StepRecipe, WeightsKept

# where a flag overrides a run's config, None = not given (the config's value, else the default)
CompileOpt = Annotated[
    Optional[bool],
    typer.Option("--compile/--no-compile", help="torch.compile (inductor): pointwise results recomputed, not kept"),
]
AttentionOpt = Annotated[
    Optional[str],
    typer.Option("--attention", help="sdpa, flash_attention_2, ... (a log-sum-exp per head) or eager (the scores)"),
]
LossOpt = Annotated[Optional[str], typer.Option("--loss", help="plain (the whole logits) or fused (a chunk at a time)")]
TiledMlpOpt = Annotated[
    Optional[bool],
    typer.Option("--tiled-mlp/--no-tiled-mlp", help="tiled_mlp: each MLP over slices of the sequence, recomputed"),
]
OptimizerStepOpt = Annotated[
    str, typer.Option("--optimizer-step", help="foreach (torch's default: a temporary per state) or fused")
]
WeightsOpt = Annotated[
    str,
    typer.Option(
        "--weights",
        help="16-bit training: autocast (meshkit: fp32 weights, 16-bit copies per forward) or master (DeepSpeed, "
        "Megatron: 16-bit weights, an fp32 master copy in the optimizer)",
    ),
]


def step_recipe(
    compiled: bool, attention: str, loss: str, optimizer_step: str, weights: str, tiled_mlp: bool = False
) -> StepRecipe:
    """The recipe the options give; a value outside a choice is a one-line error."""
    for name, value, choices in (
        ("--loss", loss, get_args(LossKind)),
        ("--optimizer-step", optimizer_step, get_args(OptimizerStep)),
        ("--weights", weights, get_args(WeightsKept)),
    ):
        if value not in choices:
            raise EstimateError(f"{name} {value}: choose {' or '.join(choices)}")
    return StepRecipe(
        attention=attention,
        compiled=compiled,
        loss=cast(LossKind, loss),
        optimizer_step=cast(OptimizerStep, optimizer_step),
        weights=cast(WeightsKept, weights),
        tiled_mlp=tiled_mlp,
    )
