"""Pipeline parallel: the block list split into stages, run by a torch.distributed.pipelining schedule.

The blocks are cut into `pp × stages_per_rank` contiguous stages balanced by parameter count, counting the
embedding with the first stage and the final norm and head with the last. A stage is the whole model with the
other stages' blocks replaced by a parameter-free `SkippedBlock`, so parameter names (and so checkpoints and
exports) are the same as without a pipeline. How the first- and last-stage modules are left out depends on
the model (the model-structure layer says which): the reference GPT and user overrides skip modules set to
None; an `nn.Sequential` is its own block list; a transformers model gets stand-ins (`hf_stage.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from meshkit.config.layout import SINGLE_STAGE, PipelineError, chunks_per_rank  # noqa: F401 - re-exported
from meshkit.models.blocks import block_list, find_blocks
from meshkit.models.structure import ModelStructure
from meshkit.parallel.pipeline.hf_stage import make_transformers_stage, plain_attributes

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}


NO_FORWARD_ONLY = "zbv_zero_bubble"  # torch's V schedule hands gradients between a rank's two stages even in eval


def forward_only_refusal(schedule: str, what: str) -> str | None:
    """The one-line reason `what` (a forward-only pass through the pipeline) cannot run on `schedule`, if any."""
    if schedule != NO_FORWARD_ONLY:
        return None
    return (
        f"{what} runs a forward-only pass through the pipeline, which torch's {NO_FORWARD_ONLY} schedule cannot "
        "(its V turn passes gradients between a rank's two stages even in eval): use schedule "
        "interleaved_zero_bubble"
    )


def schedule_class(name: str) -> type:
    """The torch schedule class, if this torch has it (the zero-bubble schedules are recent)."""
    import torch.distributed.pipelining.schedules as schedules  # (here: importing it costs a second, and most
    # runs have no pipeline)

    found = getattr(schedules, SCHEDULE_CLASSES[name], None)
    if found is None:
        present = [n for n, cls in SCHEDULE_CLASSES.items() if hasattr(schedules, cls)]
        raise PipelineError(f"schedule {name} is not in torch {torch.__version__}: choose one of {', '.join(present)}")
    return found


def stage_ids(pp_rank: int, pp: int, chunks: int, schedule: str) -> list[int]:
    """Stages this rank holds: looped (rank, rank + pp, ...) or, for ZBV, a V (rank, 2·pp − 1 − rank)."""
    if schedule == "zbv_zero_bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(chunks)]


def balanced_split(costs: list[int], stages: int, first_extra: int, last_extra: int) -> list[range]:
    """Contiguous block ranges, one per stage, minimising the largest stage's parameter count.

    `costs` are the blocks' parameter counts; the first and last stage also carry `first_extra` and
    `last_extra` (embedding; final norm and head). Every stage gets at least one block.
    """
    n = len(costs)
    if stages > n:
        raise PipelineError(
            f"{stages} pipeline stages (pp × stages_per_rank) need at least {stages} blocks, the model has {n}: "
            "lower pp or stages_per_rank"
        )
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def load(stage: int, start: int, end: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[s][i]: the smallest possible largest load when stages 0..s-1 cover blocks 0..i-1
    infinity = float("inf")
    best = [[infinity] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                candidate = max(best[s - 1][j], load(s - 1, j, i))
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    ranges, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


class SkippedBlock(nn.Module):
    """Stands in for a block that lives on another stage: no parameters, passes the hidden states on. It keeps
    the block's plain attributes (numbers, strings, flags): the model's loop may read them (Inkling's
    `attention_type` picks each layer's mask)."""

    is_placeholder = True

    def __init__(self, block: nn.Module | None = None) -> None:
        super().__init__()
        for name, value in plain_attributes(block).items():
            setattr(self, name, value)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


def _parameter_count(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def _set_submodule(model: nn.Module, name: str, module: nn.Module | None) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def split_model(model: nn.Module, stage_list: list[int], stages: int, structure: ModelStructure) -> list[nn.Module]:
    """This rank's stage modules (the model itself for a single stage, copies for several)."""
    if structure.stage_style is None:
        raise PipelineError(
            f"meshkit cannot tell which modules of {type(model).__name__} run before and after its blocks: name "
            "them in structure.first_stage / structure.last_stage (the model skips them when None), or build "
            "the model as an nn.Sequential"
        )
    first_names, last_names = structure.first_stage, structure.last_stage
    _, blocks = find_blocks(model, structure.blocks)
    first_extra = sum(_parameter_count(model.get_submodule(name)) for name in first_names)
    last_extra = sum(_parameter_count(model.get_submodule(name)) for name in last_names)
    ranges = balanced_split([_parameter_count(b) for b in blocks], stages, first_extra, last_extra)
    modules = []
    for position, stage in enumerate(stage_list):
        chunk = model if position == len(stage_list) - 1 else copy.deepcopy(model)
        chunk_blocks = block_list(chunk, structure.blocks)
        for index in range(len(chunk_blocks)):
            if index not in ranges[stage]:
                chunk_blocks[index] = SkippedBlock(chunk_blocks[index])
        first, last = stage == 0, stage == stages - 1
        if structure.stage_style == "hf":
            modules.append(make_transformers_stage(chunk, structure, first, last, ranges[stage].start))
            continue
        for name in first_names if not first else ():
            _set_submodule(chunk, name, None)
        for name in last_names if not last else ():
            _set_submodule(chunk, name, None)
        modules.append(chunk)
    return modules


class PipelineModel(nn.Module):
    """This rank's stage modules. Parameters and state dict keep the original model's names."""

    def __init__(self, chunks: list[nn.Module], stage_list: list[int], stages: int) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stage_list = stage_list
        self.stages = stages

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_list

    @property
    def has_last_stage(self) -> bool:
        return self.stages - 1 in self.stage_list

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            "with pipeline parallel the schedule runs forward and backward: use engine.train_step(batch)"
        )

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        for chunk in self.chunks:
            inner = chunk.module if isinstance(chunk, nn.parallel.DistributedDataParallel) else chunk
            yield from inner.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # nn.Module's overloads, one merged form
        merged: dict[str, Any] = {}
        for chunk in self.chunks:
            inner = chunk.module if isinstance(chunk, nn.parallel.DistributedDataParallel) else chunk
            merged.update(inner.state_dict(*args, **kwargs))
        return merged
