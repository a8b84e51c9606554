"""One resolved layout type: the config resolves it, the mesh is built from it, the planner proposes it, the
performance model costs it and `layout: auto` probes it — and nothing else in meshkit models a layout."""

from __future__ import annotations

import ast
from pathlib import Path

import meshkit
from meshkit.config.layout import Layout
from meshkit.config.schema import ParallelConfig
from meshkit.planning.estimate import ModelShape
from meshkit.planning.plan import Cluster, plan, to_config

LAYOUT_FIELDS = {"tp", "pp", "cp"}


def test_a_planned_layout_is_sharded_under_zero_3_and_replicated_otherwise() -> None:
    assert (Layout.planned(4, 2, 1, 1, 3, 2).dp_shard, Layout.planned(4, 2, 1, 1, 3, 2).dp_replicate) == (4, 1)
    assert (Layout.planned(4, 2, 1, 1, 1, 2).dp_shard, Layout.planned(4, 2, 1, 1, 1, 2).dp_replicate) == (1, 4)
    layout = Layout.planned(2, 2, 2, 1, 1, 4, "selective")
    assert (
        layout.summary() == "dp2 tp2 pp2 cp1 ZeRO-1 m4 AC selective"
        and layout.describe() == "pp2 × dp_replicate2 × tp2"
    )


def test_the_planners_layout_round_trips_through_the_config_it_emits() -> None:
    model = ModelShape.transformer(layers=8, hidden=1024, heads=16, vocab=32000)
    cluster = Cluster(4, 24.0, nodes=2)
    for planned in plan(model, cluster, seq_len=1024, global_batch=32).fitting[:20]:
        layout = planned.layout
        assert isinstance(layout, Layout)
        config = to_config(layout, cluster, seq_len=1024, global_batch=32, precision="bf16")
        resolved = Layout.from_config(ParallelConfig(**config["parallel"]), cluster.gpus)
        assert resolved.mesh_sizes() == layout.mesh_sizes() and config["sharding"]["zero_stage"] == layout.zero_stage


def test_no_other_class_in_meshkit_models_a_layout() -> None:
    """A dataclass with tp, pp and cp fields is a second layout type: use `config.layout.Layout` instead."""
    found = []
    for path in Path(meshkit.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            fields = {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
            if fields >= LAYOUT_FIELDS:
                found.append(f"{path.relative_to(Path(meshkit.__file__).parent)}:{node.name}")
    # ParallelConfig is the user's request (sizes may be -1); Layout is the one resolved layout
    assert sorted(found) == ["config/layout.py:Layout", "config/schema.py:ParallelConfig"], found
