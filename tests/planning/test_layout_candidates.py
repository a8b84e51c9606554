"""`layout: auto` proposes only layouts the run accepts: every candidate the planner emits, at every world from 1
to 8 and for every example config, passes the checks the run applies (config validation, mesh sizes, pipeline
micro-batches, ZeRO stage); one the run would refuse is named with its reason and not probed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from meshkit.config.layout import MeshError
from meshkit.config.resolve import resolve
from meshkit.planning.hardware import PRESETS
from meshkit.planning.layout_probe import Workload, candidates_on, layout_values, refusal

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [ROOT / "examples" / "demo.yaml"]
AUTO = {"layout": "auto"}
# where the example's own sizes do not fit the world, layout: auto starts from the default sizes
DEFAULT_SIZES = {"parallel": {"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1}}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_every_proposed_layout_passes_the_runs_own_checks(example: Path) -> None:
    proposed = 0
    for world in range(1, 9):
        resolved = resolve(file=example, code={**AUTO, "probe": {"top_k": 12}}, env={})
        try:
            work = Workload.of_config(resolved.config, world, world, torch.device("cpu"))
        except MeshError:
            resolved = resolve(file=example, code={**AUTO, **DEFAULT_SIZES, "probe": {"top_k": 12}}, env={})
            work = Workload.of_config(resolved.config, world, world, torch.device("cpu"))
        work = replace(work, refine=None)
        for candidate in candidates_on(resolved, world, world, work, PRESETS["a100"]):
            assert candidate.error is None, f"world {world}: {candidate.description}: {candidate.error}"
            assert refusal(resolved, candidate.values, world) is None
            if candidate.layout.pp > 1:
                assert candidate.values["pipeline.microbatches"] >= candidate.layout.pp
            proposed += 1
    assert proposed >= 30  # pipelines, tensor and sharded layouts among them


def test_a_layout_the_run_would_refuse_is_named_with_the_reason() -> None:
    resolved = resolve(file=EXAMPLES[0], code=AUTO, env={})
    values = {"parallel.pp": 2, "parallel.dp_replicate": 2, "parallel.tp": 1, "pipeline.microbatches": 1}
    assert refusal(resolved, values, 4) == "PipelineError: pipeline.microbatches=1 must be at least pp=2"
    assert refusal(resolved, {"parallel.tp": 3}, 4).startswith("MeshError: tp=3 does not divide world size 4")


def test_the_micro_batch_leaves_a_pipeline_enough_micro_batches() -> None:
    from meshkit.config.layout import Layout

    # 4 sequences per rank in micro-batches of up to 8: one micro-batch of 4 would starve pp=2
    values = layout_values(Layout.planned(2, 1, 2, 1, 0, 4), global_batch=8, micro_batch=8, seq_len=64)
    assert values["pipeline.microbatches"] == 2 and values["train.micro_batch_size"] == 4
