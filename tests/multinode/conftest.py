"""The multi-node suite: every test runs real launchers on two simulated hosts (network namespaces), so it is
marked `slow`; where namespaces cannot be made the tests are skipped with the reason."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.multinode.hosts import TwoHosts, unavailable_reason

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def hosts(request):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-node tests skipped: {reason}")
    made = TwoHosts(hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6])
    try:
        made.create()
    except OSError as err:  # a container without CAP_NET_ADMIN, no netns support, ...
        made.destroy()
        pytest.skip(f"multi-node tests skipped: cannot make network namespaces here ({err})")
    try:
        yield made
    finally:
        made.destroy()
