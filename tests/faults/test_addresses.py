"""Where the stores listen: one address per node, never every interface unless asked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshkit.config import LaunchSettings
from meshkit.launching.interfaces import gloo_interface, interface_holding, quiet_port
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


@pytest.mark.skipif(sys.platform != "linux", reason="the ephemeral range is read from /proc")
def test_a_quiet_port_is_free_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {quiet_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1  # (drawn at random)
    sock = listen("127.0.0.1", ports.pop(), "--master-addr")  # and free: it binds
    sock.close()


@pytest.mark.skipif(sys.platform != "linux", reason="interfaces are read with Linux ioctls")
def test_the_workers_use_the_interface_of_the_advertised_address() -> None:
    # gloo would otherwise take the hostname's address, which /etc/hosts often maps to 127.0.0.1
    assert interface_holding("127.0.0.1") == "lo"
    assert interface_holding("192.0.2.254") is None  # TEST-NET-1: held by no interface here
    assert gloo_interface("127.0.0.1", {}) == "lo"
    assert gloo_interface("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"}) is None  # the user's choice stands
