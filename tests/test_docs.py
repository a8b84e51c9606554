"""The README is the front door (short, two commands, links that land) and docs/ is a site that builds strictly:
a broken link or anchor, or a page missing from the navigation, fails `mkdocs build --strict`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit.config.resolve import leaf_keys

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def heading_anchors(text: str) -> set[str]:
    """Anchors of a page's headings, as the `toc` extension makes them."""
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            anchors.add(re.sub(r"\s", "-", title))
    return anchors


def test_the_readme_is_a_front_door_with_the_two_commands() -> None:
    assert len(README.splitlines()) <= 250
    assert "make demo" in README and "make test" in README


def test_every_readme_link_lands_on_a_page_and_heading() -> None:
    links = re.findall(r"\]\(((?:docs/)?[\w\-./]+\.md)(?:#([\w\-]+))?\)", README)
    assert len(links) >= 10
    for page, anchor in links:
        target = ROOT / page
        assert target.is_file(), f"README links to {page}, which does not exist"
        if anchor:
            assert anchor in heading_anchors(target.read_text()), f"README links to {page}#{anchor}: no such heading"


def site_home(readme: str) -> str:
    """docs/index.md: the README with its links made relative to docs/."""
    home = readme.replace("](docs/", "](").replace("from [docs/](index.md)", "from `docs/`")
    return home.replace("](BENCHMARKS.md)", "](benchmarks.md)")


def test_the_site_home_is_the_readme() -> None:
    assert (DOCS / "index.md").read_text() == site_home(README), (
        "docs/index.md drifted from README.md: python -c 'from tests.test_docs import site_home, README; "
        'open("docs/index.md", "w").write(site_home(README))\''
    )


def test_every_config_key_is_in_the_configuration_page() -> None:
    page = (DOCS / "configuration.md").read_text()
    missing = [key for key in leaf_keys() if f"`{key}`" not in page]
    assert not missing, f"docs/configuration.md lacks: {missing}"


def test_the_docs_site_builds_strictly(tmp_path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs-material) is not installed")
    pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    pages = {p.name for p in DOCS.glob("*.md")}
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(page in nav for page in pages), f"pages missing from mkdocs.yml's nav: {pages}"


def test_the_architecture_page_names_files_and_classes_that_exist() -> None:
    """Every `package/module.py` and `module.py:Name` the architecture page cites is there (a rename that forgets
    the page fails here); `<strategy>` placeholders are skipped."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    cited = set(re.findall(r"`([a-z_/]+\.py)(?::([A-Za-z_]+))?`", text))
    assert len(cited) >= 15  # the page cites its files
    missing = []
    for path, name in sorted(cited):
        found = ROOT / "meshkit" / path if not path.startswith("tests/") else ROOT / path
        if not found.is_file():
            missing.append(path)
        elif name and not re.search(rf"^(class|def) {name}\b|^{name} = ", found.read_text(), re.M):
            missing.append(f"{path}:{name}")
    assert not missing, f"docs/architecture.md cites what does not exist: {missing}"
