"""Which network interface the workers' own connections use, and which port a store can count on.

gloo picks its interface from this host's name unless `GLOO_SOCKET_IFNAME` names one. Where the hostname
resolves to 127.0.0.1 (a common /etc/hosts line), every worker of a multi-node job would advertise loopback and
its peers on other nodes would dial their own loopback: the job fails to connect. The launcher therefore names
the interface that holds the address this node advertises (`--local-addr`, or the route to node 0).
"""

from __future__ import annotations

import random
import socket
import struct
import sys

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return []


def interface_holding(address: str) -> str | None:
    """The name of this host's interface whose IPv4 address is `address` (Linux), else None."""
    if sys.platform != "linux":
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in interface_names():
            try:
                request = struct.pack("256s", name.encode()[:15])
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def gloo_interface(advertised: str, environ: dict[str, str]) -> str | None:
    """The value for GLOO_SOCKET_IFNAME: None when the user set it, or when no interface holds `advertised`
    (then gloo's own choice stands)."""
    if GLOO_INTERFACE_ENV in environ:
        return None
    return interface_holding(advertised)


def quiet_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, below the kernel's ephemeral range: the sockets bound to port 0 and the outgoing
    connections of every other process on this host (other jobs' gloo pairs and stores) draw from that range, so
    a port chosen in it may be taken before the store that was meant to have it binds it; one below it is not."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral_low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    low = max(1024, ephemeral_low - 12000)
    for _ in range(64):
        port = random.SystemRandom().randrange(low, ephemeral_low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # (a crowded range: any free port)
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
