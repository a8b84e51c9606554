"""Where the stores listen: one address per node, never every interface unless asked."""

from __future__ import annotations

import pytest

from meshkit.config import LaunchSettings
from meshkit.launching.stores import StoreError, listen, node_addresses


def test_one_node_binds_loopback_whatever_master_addr_says() -> None:
    assert node_addresses(LaunchSettings(master_addr="localhost")).bind == "127.0.0.1"


def test_node_0_binds_master_addr_and_others_their_local_addr() -> None:
    node0 = node_addresses(LaunchSettings(nnodes=2, node_rank=0, master_addr="127.0.0.1"))
    assert (node0.bind, node0.advertise) == ("127.0.0.1", "127.0.0.1")
    node1 = node_addresses(LaunchSettings(nnodes=2, node_rank=1, master_addr="127.0.0.1", local_addr="127.0.0.2"))
    assert (node1.bind, node1.advertise) == ("127.0.0.2", "127.0.0.2")
    routed = node_addresses(LaunchSettings(nnodes=2, node_rank=1, master_addr="127.0.0.1"))
    assert routed.advertise.startswith("127.")  # this host's address on the route to node 0


def test_every_interface_only_when_asked() -> None:
    asked = node_addresses(LaunchSettings(nnodes=2, master_addr="127.0.0.1", bind_all_interfaces=True))
    assert (asked.bind, asked.advertise) == ("0.0.0.0", "127.0.0.1")


def test_a_listening_socket_is_on_exactly_the_address_given() -> None:
    sock = listen("127.0.0.1", 0, "--master-addr")
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
        with pytest.raises(StoreError, match=r"port \d+ is in use on 127.0.0.1"):
            listen("127.0.0.1", sock.getsockname()[1], "--master-addr")
    finally:
        sock.close()
