"""Does a layout fit a model? The refusals that depend on the model's structure alone (its head counts, blocks and
experts), in one place: `parallelize` runs them before splitting anything, and the launcher runs them on the model
built on the meta device before any worker starts — so a layout that cannot fit stops in one line, at once, and
every size it offers fits both the model and the world.
"""

from __future__ import annotations

from torch import nn

from meshkit.config.layout import Layout, PipelineError, check_pipeline, choices_text, chunks_per_rank, divisors
from meshkit.config.schema import RunConfig
from meshkit.models.blocks import find_blocks
from meshkit.models.structure import ModelStructure
from meshkit.parallel.expert.apply import check_expert_parallel
from meshkit.parallel.tensor.apply import check_heads


def check_layout_fits(model: nn.Module, structure: ModelStructure, dims: Layout, config: RunConfig) -> None:
    """Raise one line naming the size to change when `dims` cannot split `model` (read through `structure`)."""
    world = dims.world_size
    if dims.tp > 1:
        check_heads(structure, dims.tp, ranks=world // (dims.pp * dims.cp))
    if dims.ep > 1:
        check_expert_parallel(structure.moe, dims.ep, dims.dp_replicate * dims.dp_shard * dims.cp, config.strategy)
    if dims.pp > 1:
        check_pipeline(config.pipeline, dims.pp, grad_accum_steps=config.grad_accum_steps)
        chunks = chunks_per_rank(config.pipeline)
        if structure.stage_style is None or structure.blocks is None:
            return  # (the pipeline split names what to set, with the model at hand)
        blocks = len(find_blocks(model, structure.blocks)[1])
        if dims.pp * chunks > blocks:
            fits = [d for d in divisors(world) if d * chunks <= blocks]
            raise PipelineError(
                f"pp={dims.pp} × {chunks} stage(s) per rank needs at least {dims.pp * chunks} blocks, the model has "
                f"{blocks}: choose pp {choices_text(fits)}"
            )
