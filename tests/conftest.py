from __future__ import annotations

import os
import shutil
import tempfile

import pytest

WORLD8_LAYOUTS = {"pp2_dp2_tp2": ("gpt4", {"pp": 2, "dp_replicate": 2, "tp": 2})}
# Test files that share a session's world (`world8`): under pytest-xdist they run on one worker, so it is built once.
SHARED_WORLDS = {"tests/runtime/test_mesh.py": "world8", "tests/parallel/test_pipeline.py": "world8"}


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest workers (pytest-xdist): the suite keeps about one core busy by itself, much of
    its time goes to starting processes and waiting on them. Each test file runs whole on one worker (its module
    fixtures build their worlds once); files that share a session world go to the same worker."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_WORLDS.get(path, path)

    return FileScheduling(config, log)


def pytest_configure(config) -> None:
    """No hub access (there is none here: fail at once rather than retry), and Hugging Face datasets' cache in a
    directory of this session's own (set before `datasets` is imported: it reads the variable once)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="meshkit-test-datasets-")
    config.stash[_DATASETS_CACHE] = os.environ["HF_DATASETS_CACHE"]


def pytest_unconfigure(config) -> None:
    shutil.rmtree(config.stash.get(_DATASETS_CACHE, ""), ignore_errors=True)


_DATASETS_CACHE = pytest.StashKey[str]()


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    """No user config file, no MESHKIT_* or scheduler (SLURM, PyTorchJob) variables — the suite behaves the same
    inside a cluster job — and a fresh run directory for every test."""
    import os

    for name in list(os.environ):
        if name.startswith(("MESHKIT_", "SLURM_", "PET_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("MESHKIT_LOGGING__DIR", str(tmp_path / "run"))
    return tmp_path


def _world8_rank(rank: int) -> dict:
    from tests.helpers.distributed import gloo_world
    from tests.helpers.layouts import run_layouts
    from tests.runtime.test_mesh import mesh_answers

    with gloo_world():
        return {"mesh": mesh_answers(), "layouts": run_layouts(rank, WORLD8_LAYOUTS)}


@pytest.fixture(scope="session")
def world8() -> list[dict]:
    """One world of 8 ranks, shared by the tests that need 8 (starting 8 processes on a small host is slow)."""
    from tests.helpers.distributed import run_world

    return run_world(_world8_rank, 8, timeout=400)


@pytest.fixture(scope="session")
def material(tmp_path_factory) -> dict:
    """Fine-tuning material made once per session (tests/finetune_runs.make_material): JSONL data and a tiny Llama
    base model with its tokenizer. Tests read it and never write into it."""
    from tests.helpers.finetune_runs import make_material

    return make_material(tmp_path_factory.mktemp("finetune-material"))


@pytest.fixture(scope="session")
def tokenizer(material):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(material["base"])


def pytest_collection_modifyitems(config, items) -> None:
    """Tests that start processes are marked `world`; `make test-fast` runs the rest (single process, seconds)."""
    import inspect
    import textwrap
    from pathlib import Path

    from tests.helpers.spawning import spawning_functions, spawns

    spawning = spawning_functions(Path(__file__).parent)
    for item in items:
        function = getattr(item, "function", None)
        if function is None or item.get_closest_marker("world"):
            continue
        source = textwrap.dedent(inspect.getsource(function))
        if spawns(source, list(item.fixturenames), spawning):
            item.add_marker(pytest.mark.world)


@pytest.fixture(autouse=True)
def single_process_tests_stay_single(request, monkeypatch):
    """A test not marked `world` that starts a Python process (a rank, a launcher, the meshkit command) fails: mark
    it `@pytest.mark.world`. Tools libraries run on their own (ldconfig, git) are not counted."""
    if request.node.get_closest_marker("world"):
        return
    import multiprocessing.process
    import subprocess
    import sys
    from pathlib import Path

    message = f"{request.node.nodeid} starts a process but is not marked world: add @pytest.mark.world"
    popen_init = subprocess.Popen.__init__

    def checked_popen(self, args, *rest, **kwargs):
        program = Path(str(args[0] if isinstance(args, (list, tuple)) else str(args).split()[0])).name
        if program.startswith(("python", "meshkit")) or program == Path(sys.executable).name:
            raise AssertionError(message)
        popen_init(self, args, *rest, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError(message)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
