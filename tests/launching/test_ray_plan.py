"""The Ray backend's decisions that need no cluster: ranks from placements, each rank's environment, what the
settings mean under each backend, and the one line when Ray is missing."""

from __future__ import annotations

import builtins

import pytest

from meshkit.config import LaunchSettings, RunConfig
from meshkit.config.idle import idle_values
from meshkit.config.resolve import resolve
from meshkit.launching.job import LaunchPlan, LaunchTarget
from meshkit.launching.launch import launch
from meshkit.launching.preflight import check_layout
from meshkit.launching.ray_backend import RAY_MISSING, RayLaunchError, assign_ranks, rank_env
from meshkit.launching.ray_rank import Placement
from meshkit.launching.worker import LAUNCH_LOG_ENV


def test_ranks_fill_node_by_node_and_local_ranks_follow_the_gpus() -> None:
    placements = [
        Placement("node-b", "10.0.0.2", ("3",), 4001),
        Placement("node-a", "10.0.0.1", ("1",), 4002),
        Placement("node-b", "10.0.0.2", ("2",), 4003),
        Placement("node-a", "10.0.0.1", ("0",), 4004),
    ]
    ranked = assign_ranks(placements)
    assert [index for index, _ in ranked] == [2, 0, 3, 1]  # node-b first (first seen), its GPU 2 before 3
    ranks = [rank for _, rank in ranked]
    assert [r.rank for r in ranks] == [0, 1, 2, 3]
    assert [(r.node_rank, r.local_rank, r.local_world) for r in ranks] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]


def test_a_rank_gets_what_the_elastic_launcher_gives_its_workers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MESHKIT_TRAIN__STEPS", "7")  # the person's env-level config reaches every node
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    settings = LaunchSettings(backend="ray", ray_num_workers=4, ray_cpus_per_worker=2, max_restarts=1)
    (tmp_path / "c.yaml").write_text("seed: 3\n")
    plan = LaunchPlan(settings, log_dir=tmp_path, config_file=str(tmp_path / "c.yaml"), flags={"precision": "bf16"})
    ranked = assign_ranks([Placement("a", "10.0.0.1", ("0",), 4100), Placement("b", "10.0.0.2", ("5",), 4200)])
    master = ranked[0][1].placement
    env = rank_env(ranked[1][1], 2, master, 1, plan, node_gpus="5")
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["WORLD_SIZE"]) == ("1", "0", "1", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "4100")  # rank 0's node hosts the store
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1" and env["TORCHELASTIC_MAX_RESTARTS"] == "1"
    assert env["OMP_NUM_THREADS"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "5"
    assert env["MESHKIT_TRAIN__STEPS"] == "7" and env["MESHKIT_LAUNCHER_STORE_BIND"] == "10.0.0.1"
    assert env[LAUNCH_LOG_ENV].endswith("ray-node1.log")
    seen = resolve(env=env).config  # the worker's view: nothing the driver adds is taken for a wrong key
    assert (seen.train.steps, seen.seed, seen.precision) == (7, 3, "bf16")
    assert seen.threads_per_process is None  # the OMP_NUM_THREADS the launcher chose is not the user's setting


def test_the_world_under_ray_is_its_workers() -> None:
    assert LaunchSettings(backend="ray", ray_num_workers=3, nproc_per_node=2).world_size == 3
    assert LaunchSettings(backend="ray", nproc_per_node=2, nnodes=2).world_size == 4
    assert LaunchSettings(nproc_per_node=2, ray_num_workers=3).world_size == 2  # elastic: ray_* have no say
    config = RunConfig(launch={"backend": "ray", "ray_num_workers": 3}, parallel={"tp": 2})
    with pytest.raises(Exception, match=r"3 Ray worker"):
        check_layout(config)


def test_settings_that_do_nothing_under_the_chosen_backend_say_so() -> None:
    resolved = resolve(flags={"launch.backend": "ray", "launch.master_addr": "10.1.1.1", "launch.node_rank": 0})
    notes = idle_values(resolved.config, dict(resolved.sources))
    assert len(notes) == 2 and all("has no effect under launch.backend=ray" in note for note in notes)
    elastic = resolve(flags={"launch.ray_address": "auto"})
    [note] = idle_values(elastic.config, dict(elastic.sources))
    assert note.startswith("ray_address=auto (flag") and "without launch.backend=ray" in note


def test_without_ray_installed_the_launch_is_one_line(tmp_path, monkeypatch) -> None:
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    script = tmp_path / "s.py"
    script.write_text("print('never')\n")
    with pytest.raises(RayLaunchError, match="pip install 'meshkit\\[ray\\]'") as caught:
        launch(LaunchTarget(str(script)), LaunchPlan(LaunchSettings(backend="ray")))
    assert str(caught.value) == RAY_MISSING
