"""Layout validation and the rank questions of ParallelMesh."""

from __future__ import annotations

import pytest
import torch

from meshkit.config import ParallelConfig
from meshkit.config.layout import Layout, MeshError
from meshkit.runtime.mesh import ParallelMesh, ProcessInfo, select_device


def dims(world: int, **sizes: int) -> Layout:
    return Layout.from_config(ParallelConfig(**sizes), world)


def test_the_rest_fills_the_world() -> None:
    assert dims(8).dp_replicate == 8
    d = dims(8, tp=2, pp=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (2, 2, 1, 1, 2)
    assert d.describe() == "pp2 × dp_replicate2 × tp2" and d.dp == 2 and d.world_size == 8
    d = dims(8, dp_shard=-1, tp=2)
    assert (d.dp_replicate, d.dp_shard) == (1, 4)
    assert dims(1).describe() == "single process"


@pytest.mark.parametrize(
    ("world", "sizes", "message"),
    [
        (8, {"tp": 3}, "tp=3 does not divide world size 8: choose 1, 2, 4 or 8"),
        (8, {"dp_replicate": 2, "tp": 2}, "multiply to 4, but the world size is 8"),
        (4, {"tp": 4, "pp": 2, "dp_replicate": -1}, "pp=2 × tp=4 = 8 does not divide world size 4"),
    ],
)
def test_sizes_that_do_not_fit_say_what_to_change(world, sizes, message) -> None:
    with pytest.raises(MeshError) as err:
        dims(world, **sizes)
    assert message in str(err.value)


def test_process_info_from_env() -> None:
    assert ProcessInfo.from_env({}) == ProcessInfo()
    info = ProcessInfo.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size, info.launched) == (3, 1, 4, 2, True)


def test_device_selection_on_a_cpu_host() -> None:
    assert select_device("cpu", 0).type == "cpu"
    assert select_device("auto", 0).type == ("cuda" if torch.cuda.is_available() else "cpu")


def mesh_answers() -> dict:
    """This rank's answers on a pp=2 × dp=2 × tp=2 mesh (the world of 8 is shared: tests/conftest.py)."""
    info = ProcessInfo.from_env()
    device = select_device("cpu", info.local_rank)
    mesh = ParallelMesh(dims(8, pp=2, tp=2), info, device)
    return {
        "pp": mesh.coordinate("pp"),
        "dp": mesh.dp_rank,
        "tp": mesh.coordinate("tp"),
        "dp_size": mesh.dp_size,
        "first": mesh.is_first_stage,
        "last": mesh.is_last_stage,
        "main": mesh.is_main_process,
    }


def test_rank_questions_on_a_pp2_dp2_tp2_mesh(world8) -> None:
    answers = [rank_results["mesh"] for rank_results in world8]
    # row-major over (pp, dp_replicate, dp_shard, cp, tp): rank = pp * 4 + dp * 2 + tp
    for rank, answer in enumerate(answers):
        assert answer["pp"] == rank // 4 and answer["dp"] == (rank // 2) % 2 and answer["tp"] == rank % 2
        assert answer["dp_size"] == 2
        assert answer["first"] == (rank < 4) and answer["last"] == (rank >= 4)
        assert answer["main"] == (rank == 0)
