"""`launch.backend: ray` on a real local Ray cluster (a head and a second node on this host): the demo trains to
the same weights as under the elastic launcher, a failing rank is one line, and a killed Ray worker is restarted
and resumes from the last checkpoint. Skipped, with the reason, where Ray is not installed or cannot start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.faults.helpers import is_loopback
from tests.helpers.cli import ROOT, meshkit
from tests.helpers.distributed import run_world
from tests.helpers.training import train_recipe

pytestmark = [pytest.mark.world, pytest.mark.slow]
QUIET_RAY = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}


@pytest.fixture(scope="module")
def ray_address() -> str:
    """A two-node Ray cluster on this host, 2 CPUs per node, for every test here."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'meshkit[ray]')")
    from ray.cluster_utils import Cluster

    os.environ.update(QUIET_RAY)
    try:
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 2, "object_store_memory": 100 * 2**20, "include_dashboard": False},
        )
        cluster.add_node(num_cpus=2, object_store_memory=100 * 2**20)
    except Exception as err:  # a sandbox without /dev/shm, ports or process limits Ray needs
        pytest.skip(f"a local Ray cluster could not start here: {type(err).__name__}: {err}")
    yield cluster.address
    cluster.shutdown()


def _train(tmp_path: Path, name: str, *overrides: str, timeout: float = 300) -> tuple[dict, str]:
    run = tmp_path / name
    proc = meshkit("train", "examples/demo.yaml", "train.steps=6", "train.log_every=3", f"logging.dir={run}",
                   *overrides, timeout=timeout, env=QUIET_RAY)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run / "summary.json").read_text()), proc.stdout + proc.stderr


@pytest.mark.sweep  # (the suite trains on Ray in the restart test below)
def test_the_demo_on_ray_trains_to_the_weights_of_the_elastic_launcher(tmp_path, ray_address) -> None:
    elastic, _ = _train(tmp_path, "elastic")
    on_ray, output = _train(
        tmp_path, "ray", "launch.backend=ray", f"launch.ray_address={ray_address}", "launch.ray_placement=SPREAD"
    )
    assert on_ray["world_size"] == elastic["world_size"] == 4
    assert on_ray["params_sha256"] == elastic["params_sha256"]
    assert on_ray["final_loss"] == elastic["final_loss"]
    assert "params sha256" in output  # the summary, printed by rank 0 through the driver


def test_a_failing_rank_on_ray_is_one_line_naming_it(tmp_path, ray_address) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        "import torch\nfrom meshkit import Engine\nengine = Engine()\n"
        "engine.reduce(torch.ones(1), op='sum')\n"
        "if engine.process_index == 1:\n    raise ValueError('boom on rank 1')\n"
        "engine.wait_for_everyone()\nengine.end()\n"
    )
    proc = meshkit("launch", "--backend", "ray", "--ray-address", ray_address, "--nproc-per-node", "2", str(script),
                   timeout=180, env=QUIET_RAY)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("meshkit launch: rank 1 (local rank") and "ValueError: boom on rank 1" in last
    assert "Traceback" in proc.stderr  # the rank's own error keeps its traceback


def _recovery_config(tmp_path: Path, name: str) -> Path:
    text = tmp_path / "corpus.txt"
    if not text.exists():
        text.write_text(("the quick brown fox jumps over the lazy dog; " * 40)[: 40 * 32 + 1])
    config = {
        "launch": {"nproc_per_node": 2, "max_restarts": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 2, "resume": "auto"},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32},
        "train": {"steps": 14, "micro_batch_size": 2, "seq_len": 32, "dataset": str(text), "log_every": 7},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _rank_worker(tag: str, rank: int) -> int | None:
    """The pid of the first attempt's worker of `rank` in the run whose config path holds `tag`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        first_attempt = b"TORCHELASTIC_RESTART_COUNT=0" in environ
        if tag.encode() in command and f"RANK={rank}".encode() in environ and first_attempt:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the Ray worker through /proc")
def test_a_killed_ray_worker_is_restarted_and_the_run_resumes_from_its_checkpoint(tmp_path, ray_address) -> None:
    # the uninterrupted run: what each Ray actor's rank runs, in a world of the same size
    run_dir = f"logging.dir={tmp_path / 'whole'}"  # an argument: it outranks the suite's MESHKIT_LOGGING__DIR
    reference = run_world(train_recipe, 2, str(_recovery_config(tmp_path, "whole")), [run_dir], timeout=240)[0]

    config = _recovery_config(tmp_path, "killed")
    job = subprocess.Popen(
        [sys.executable, "-m", "meshkit.cli", "train", str(config), "launch.backend=ray",
         f"launch.ray_address={ray_address}", f"logging.dir={tmp_path / 'killed'}"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **QUIET_RAY}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    while not latest.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    worker = _rank_worker(str(config), rank=1)
    assert worker is not None and latest.exists(), "no checkpoint was committed before the job ended"
    actor = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the worker's parent
    os.kill(actor, signal.SIGKILL)  # the Ray worker process (the rank's actor); its child goes with it
    try:
        out, err = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        pytest.fail(f"the job did not finish within 240s:\n{err[-3000:]}")
    assert job.returncode == 0, err[-3000:]
    assert "rank 1 (local rank" in err and "was lost with its Ray actor" in err and "restarting every rank" in err
    resumed = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert 0 < resumed["resumed_at_step"] < 14, "the restarted ranks did not resume from a checkpoint"
    assert resumed["params_sha256"] == reference["params_sha256"]


def test_without_an_address_the_job_runs_on_a_local_cluster_of_its_own(tmp_path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'meshkit[ray]')")
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys\nimport torch\nfrom meshkit import Engine\nengine = Engine()\n"
        "total = engine.reduce(torch.tensor(float(engine.process_index)), op='sum').item()\n"
        "sys.stdout.write(f'RANK {engine.process_index} of {engine.num_processes} sum {total:g} "
        'threads {os.environ["OMP_NUM_THREADS"]}\\n\')\n' + LISTENERS_OF_RAY + "engine.end()\n"
    )
    proc = meshkit("launch", "--backend", "ray", "--nproc-per-node", "2", str(script), timeout=180, env=QUIET_RAY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANK 0 of 2 sum 1 threads 1" in proc.stdout and "RANK 1 of 2 sum 1 threads 1" in proc.stdout
    # the cluster started for this run listens on loopback only: its GCS and raylet open no port to the network
    listeners = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("LISTEN ")]
    assert {name for name, _ in listeners} >= {"gcs_server", "raylet"}, proc.stdout[-2000:]
    assert all(is_loopback(address) for _, address in listeners), listeners


# Printed by rank 0 while the cluster runs: each TCP socket this run's GCS and raylet listen on (this run's: the
# raylet above the rank, and the GCS beside it under the driver; another cluster may run on the host meanwhile).
LISTENERS_OF_RAY = f"""
if engine.process_index == 0:
    sys.path.insert(0, {str(ROOT)!r})
    from tests.faults.helpers import listening_addresses

    def parent(pid):
        return int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])

    def name(pid):
        return open(f"/proc/{{pid}}/comm").read().strip()

    raylet = os.getpid()
    while name(raylet) != "raylet":
        raylet = parent(raylet)
    driver = parent(raylet)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ours = parent(pid) == driver and name(pid) in ("gcs_server", "raylet")
        except OSError:
            continue
        for address in listening_addresses([int(pid)]) if ours else []:
            print("LISTEN", name(pid), address)
"""
