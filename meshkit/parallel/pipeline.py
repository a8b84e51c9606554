"""Pipeline parallel: the block list split into stages, run by a torch.distributed.pipelining schedule.

The blocks are cut into `pp × stages_per_rank` contiguous stages balanced by parameter count, counting the
embedding with the first stage and the final norm and head with the last. A stage is the whole model with the
other stages' blocks replaced by a parameter-free `SkippedBlock` and the first/last-stage modules set to None,
so parameter names (and so checkpoints and exports) are the same as without a pipeline. The model names those
modules in `pipeline_first` / `pipeline_last` and skips them when None (the reference GPT does).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.pipelining.schedules as schedules
from torch import nn

from meshkit.config import PipelineConfig
from meshkit.errors import MeshkitError
from meshkit.parallel.blocks import find_blocks

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}
SINGLE_STAGE = {"gpipe", "1f1b"}  # one model chunk per rank; the others take several


class PipelineError(MeshkitError):
    """A pipeline layout that cannot run; the message says what to change."""


def schedule_class(name: str) -> type:
    """The torch schedule class, if this torch has it (the zero-bubble schedules are recent)."""
    found = getattr(schedules, SCHEDULE_CLASSES[name], None)
    if found is None:
        present = [n for n, cls in SCHEDULE_CLASSES.items() if hasattr(schedules, cls)]
        raise PipelineError(f"schedule {name} is not in torch {torch.__version__}: choose one of {', '.join(present)}")
    return found


def chunks_per_rank(cfg: PipelineConfig) -> int:
    """Model chunks each rank holds: 1 for GPipe and 1F1B, `stages_per_rank` (default 2) for the others."""
    if cfg.schedule in SINGLE_STAGE:
        if cfg.stages_per_rank not in (None, 1):
            raise PipelineError(
                f"schedule {cfg.schedule} runs one stage per rank, not {cfg.stages_per_rank}: "
                "use interleaved_1f1b for several"
            )
        return 1
    chunks = cfg.stages_per_rank or 2
    if cfg.schedule == "zbv_zero_bubble" and chunks != 2:
        raise PipelineError(f"zbv_zero_bubble runs exactly 2 stages per rank (a V shape), not {chunks}")
    if chunks < 2:
        raise PipelineError(f"schedule {cfg.schedule} interleaves several stages per rank: set stages_per_rank >= 2")
    return chunks


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
    """Stands in for a block that lives on another stage: no parameters, passes the hidden states on."""

    is_placeholder = True

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


def _parameter_count(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def split_model(
    model: nn.Module, stage_list: list[int], stages: int, blocks_path: str | None = None
) -> list[nn.Module]:
    """This rank's stage modules (the model itself for a single stage, copies for several)."""
    first_names = getattr(model, "pipeline_first", None)
    last_names = getattr(model, "pipeline_last", None)
    if first_names is None or last_names is None:
        raise PipelineError(
            f"{type(model).__name__} does not name its first- and last-stage modules: give it pipeline_first / "
            "pipeline_last attributes (e.g. ('tok_embeddings',) and ('norm', 'output')) and skip them when None"
        )
    block_path, blocks = find_blocks(model, blocks_path)
    first_extra = sum(_parameter_count(getattr(model, name)) for name in first_names)
    last_extra = sum(_parameter_count(getattr(model, name)) for name in last_names)
    ranges = balanced_split([_parameter_count(b) for b in blocks], stages, first_extra, last_extra)
    modules = []
    for position, stage in enumerate(stage_list):
        chunk = model if position == len(stage_list) - 1 else copy.deepcopy(model)
        chunk_blocks = chunk.get_submodule(block_path)
        for index in range(len(chunk_blocks)):
            if index not in ranges[stage]:
                chunk_blocks[index] = SkippedBlock()
        for name in first_names if stage != 0 else ():
            setattr(chunk, name, None)
        for name in last_names if stage != stages - 1 else ():
            setattr(chunk, name, None)
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

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        merged: dict[str, Any] = {}
        for chunk in self.chunks:
            inner = chunk.module if isinstance(chunk, nn.parallel.DistributedDataParallel) else chunk
            merged.update(inner.state_dict(*args, **kwargs))
        return merged
