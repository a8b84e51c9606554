"""A scheduler's variables become the launch settings: SLURM (srun, one launcher per node) and PyTorchJob."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshkit.config.resolve import resolve
from meshkit.launching.cluster import ClusterEnvError, cluster_settings, expand_hostlist
from tests.helpers.cli import meshkit
from tests.helpers.distributed import free_port
from tests.launching.test_launch import SCRIPT, results

SRUN = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "4",
    "SLURM_NTASKS": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-09,12]",
    "SLURM_GPUS_ON_NODE": "8",
}


def test_slurm_hostlists_expand_as_scontrol_does() -> None:
    assert expand_hostlist("gpu[07-09,12]") == ["gpu07", "gpu08", "gpu09", "gpu12"]
    assert expand_hostlist("login1,node[1-2]") == ["login1", "node1", "node2"]
    assert expand_hostlist("a-b-3") == ["a-b-3"]


def test_an_srun_step_gives_nodes_node_rank_master_and_gpus() -> None:
    values, labels = cluster_settings(SRUN)
    assert values == {
        "launch.nnodes": 4,
        "launch.node_rank": 2,
        "launch.master_addr": "gpu07",
        "launch.nproc_per_node": 8,
    }
    assert labels["launch.node_rank"] == "env SLURM_NODEID (SLURM)"
    assert cluster_settings({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}) == ({}, {})  # sbatch, not srun


def test_more_than_one_task_per_node_is_refused_in_one_line() -> None:
    with pytest.raises(ClusterEnvError, match=r"srun started 32 tasks on 4 node\(s\).*--ntasks-per-node=1") as caught:
        cluster_settings({**SRUN, "SLURM_NTASKS": "32"})
    assert "\n" not in str(caught.value)


def test_a_pytorchjob_pod_gives_the_launch_from_pet_or_plain_variables() -> None:
    pet = {
        "PET_NNODES": "2:4",
        "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "8",
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456",
        "PET_OTHER": "x",
    }
    assert cluster_settings(pet)[0] == {
        "launch.nnodes": 4,
        "launch.min_nnodes": 2,
        "launch.node_rank": 1,
        "launch.nproc_per_node": 8,
        "launch.master_addr": "job-master-0",
        "launch.master_port": 23456,
    }
    plain = {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "3",
        "RANK": "2",
    }
    assert cluster_settings(plain)[0] == {
        "launch.nnodes": 3,
        "launch.node_rank": 2,
        "launch.master_addr": "job-master-0",
        "launch.master_port": 23456,
    }
    assert cluster_settings({"MASTER_ADDR": "x", "WORLD_SIZE": "2", "RANK": "0"}) == ({}, {})  # not a pod


def test_scheduler_values_sit_above_the_file_and_below_meshkit_variables_and_flags(tmp_path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text("launch:\n  nnodes: 1\n  nproc_per_node: 2\n  master_addr: file-host\n")
    env = {"MESHKIT_LAUNCH__NPROC_PER_NODE": "4"}
    resolved = resolve(
        env=env,
        file=config,
        flags={"launch.master_addr": "flag-host"},
        flag_labels={"launch.master_addr": "flag --master-addr"},
        cluster=cluster_settings(SRUN),
    )
    launch, sources = resolved.config.launch, resolved.sources
    assert (launch.nnodes, launch.node_rank, launch.nproc_per_node, launch.master_addr) == (4, 2, 4, "flag-host")
    assert sources["launch.nnodes"] == "env SLURM_NNODES (SLURM)"
    assert sources["launch.nproc_per_node"] == "env MESHKIT_LAUNCH__NPROC_PER_NODE"


@pytest.mark.slow
def test_two_srun_tasks_on_one_host_launch_a_two_node_job_without_flags(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    base = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": "5",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_GPUS_ON_NODE": "1",
    }
    command = [sys.executable, "-m", "meshkit.cli", "launch", "--master-port", port, str(script)]
    node0 = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**base, "SLURM_NODEID": "0"}
    )
    try:
        node1 = subprocess.run(command, capture_output=True, text=True, timeout=90, env={**base, "SLURM_NODEID": "1"})
        out0, err0 = node0.communicate(timeout=90)
    finally:
        node0.kill()
    assert node1.returncode == 0 and node0.returncode == 0, node1.stderr + err0
    rows = results(out0) + results(node1.stdout)
    assert sorted(row["rank"] for row in rows) == [0, 1] and all(row["world"] == 2 for row in rows)


def test_a_bad_scheduler_environment_is_one_line_on_the_command_line(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = meshkit("launch", str(script), env={**SRUN, "SLURM_NTASKS": "32"})
    assert proc.returncode == 2 and "srun started 32 tasks" in proc.stderr, proc.stderr


def test_config_show_names_the_scheduler_variable_behind_a_value() -> None:
    proc = meshkit("config", "show", env=SRUN)
    assert proc.returncode == 0, proc.stderr
    line = next(row for row in proc.stdout.splitlines() if "launch.node_rank" in row)
    assert "2" in line and "SLURM_NODEID" in line
