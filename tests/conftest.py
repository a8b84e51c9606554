from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    """No user config file, no MESHKIT_* variables and a fresh run directory for every test."""
    import os

    for name in list(os.environ):
        if name.startswith("MESHKIT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("MESHKIT_LOGGING__DIR", str(tmp_path / "run"))
    return tmp_path
