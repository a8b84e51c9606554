"""The README documents every config key and both set-up commands."""

from __future__ import annotations

from pathlib import Path

from meshkit.resolve import leaf_keys

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_config_key_is_in_the_readme() -> None:
    missing = [key for key in leaf_keys() if f"`{key}`" not in README]
    assert not missing, f"README config table lacks: {missing}"


def test_readme_shows_the_two_commands() -> None:
    assert "make demo" in README and "make test" in README
