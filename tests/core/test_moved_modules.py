"""Module paths from before the package layout still import — the same module, with a deprecation warning."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import meshkit
from meshkit.core.moved_modules import MOVED_MODULES, MovedModuleFinder


def test_an_old_path_imports_the_new_module_and_says_where_it_lives(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "meshkit.estimate", raising=False)
    with pytest.warns(DeprecationWarning, match=r"meshkit\.estimate moved to meshkit\.planning\.estimate"):
        old = importlib.import_module("meshkit.estimate")
    new = importlib.import_module("meshkit.planning.estimate")
    assert old is new
    monkeypatch.delitem(sys.modules, "meshkit.estimate")
    with pytest.warns(DeprecationWarning):
        from meshkit.estimate import estimate_memory  # the documented spelling of issue 22's README
    assert estimate_memory is new.estimate_memory


def test_every_old_path_names_a_module_that_exists_and_no_file_serves_it() -> None:
    for old, new in MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, new
        parent = old.rpartition(".")[0]
        package_path = importlib.import_module(parent).__path__
        assert importlib.machinery.PathFinder.find_spec(old, package_path) is None, f"a file still serves {old}"
        assert MovedModuleFinder().find_spec(old) is not None


def test_the_public_names_stay_where_they_were() -> None:
    from meshkit.cli import main
    from meshkit.config import LaunchSettings, RunConfig
    from meshkit.config.schema import LaunchSettings as launch_settings_from_schema
    from meshkit.engine import Engine

    assert meshkit.RunConfig is RunConfig and meshkit.Engine is Engine
    assert callable(main) and LaunchSettings is launch_settings_from_schema


def test_reading_a_config_and_estimating_import_no_torch() -> None:
    code = (
        "import sys, meshkit, meshkit.config.resolve, meshkit.planning.estimate, meshkit.planning.plan\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('meshkit'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
