"""The job's key-value stores, bound to one address, never to every interface unless asked.

torch's TCPStore server listens on the wildcard address when it binds its own socket. The stores have no
authentication, so anyone who can reach the host could join or poison them. meshkit binds the socket itself
(to loopback on one node, to the node's own address on several) and hands it to the store.

Two stores serve a job: the rendezvous store on node 0 (the launcher's, at `master_addr:master_port`), and
the per-attempt store the workers meet in, hosted by global rank 0's worker at the address its node
advertises (`local_addr`).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

from meshkit.config.schema import LaunchSettings
from meshkit.core.errors import MeshkitError

LOOPBACK = "127.0.0.1"
WILDCARD = "0.0.0.0"
# Set by the launcher for its workers: the address the worker store binds ("" = every interface).
ENV_STORE_BIND = "MESHKIT_LAUNCHER_STORE_BIND"
WORKER_STORE_TIMEOUT_S = 900.0  # the server's own; each client waits as long as its collective timeout


class StoreError(MeshkitError):
    """A store could not be bound or reached; the message names the address and what to change."""


@dataclass(frozen=True)
class Addresses:
    """Where this node's stores listen and what it tells the other nodes."""

    bind: str  # the address sockets bind to ('0.0.0.0' only with bind_all_interfaces)
    advertise: str  # the address the other nodes dial (this node's local_addr)


def node_addresses(settings: LaunchSettings) -> Addresses:
    """Loopback on one node; otherwise `local_addr`, else `master_addr` on node 0 (it owns that address),
    else the address this host uses to reach node 0."""
    if settings.nnodes == 1:
        advertise = settings.local_addr or LOOPBACK
    elif settings.node_rank == 0:
        advertise = settings.local_addr or resolve(settings.master_addr, "--master-addr")
    else:
        advertise = settings.local_addr or route_source(settings.master_addr)
    return Addresses(WILDCARD if settings.bind_all_interfaces else advertise, advertise)


def route_source(remote: str) -> str:
    """This host's address on the route to `remote` (no packet is sent: a UDP connect only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((resolve(remote, "--master-addr"), 9))
            return probe.getsockname()[0]
        except OSError as err:
            raise StoreError(
                f"no route from this host to --master-addr {remote} ({err.strerror}): check the address"
            ) from None


def resolve(host: str, label: str) -> str:
    """The IPv4 address of `host`, or a StoreError naming it."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, UnicodeError, ValueError) as err:
        raise StoreError(f"{label} {host} does not resolve to an address ({err}): check the name") from None


def listen(host: str, port: int, label: str) -> socket.socket:
    """A listening socket on exactly `host:port` (0 = any free port), with an error that says what is wrong."""
    address = resolve(host, label) if host != WILDCARD else WILDCARD
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise StoreError(f"port {port} is in use on {address}: choose another with --master-port") from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise StoreError(
                f"{label} {host} ({address}) is not an address of this host: the node that hosts the store must "
                "own it (node 0 for --master-addr; --local-addr names this node's own address)"
            ) from None
        raise StoreError(f"cannot listen on {address}:{port} ({err.strerror}) for {label} {host}") from None
    sock.set_inheritable(False)
    return sock


def serve(sock: socket.socket, timeout_s: float) -> TCPStore:
    """A multi-tenant TCPStore server on an already bound socket (torch's own users in this process reuse it).
    The store takes the socket over: the Python object lets go of it, or collecting it would close it."""
    host, port = sock.getsockname()[:2]
    return TCPStore(
        host,
        port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        timeout=timedelta(seconds=timeout_s),
    )


def wait_reachable(host: str, port: int, timeout_s: float, label: str) -> None:
    """Dial `host:port` until it answers, quietly (torch's own client logs a C++ trace per failed try)."""
    address = resolve(host, label)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=min(5.0, timeout_s)):
                return
        except OSError as err:
            if time.monotonic() + 0.5 >= deadline:
                raise StoreError(
                    f"could not reach node 0 at {host}:{port} within {timeout_s:g}s ({err.strerror or err}): "
                    "start node 0 first and check --master-addr/--master-port"
                ) from None
            time.sleep(0.5)


def host_worker_store(env: dict[str, str] | os._Environ[str]) -> TCPStore | None:
    """In global rank 0's worker: host this attempt's store on the address the launcher chose, and make
    every worker's `init_process_group(env://)` a client of it. Returns the server to keep alive (or None
    when this worker does not host, or the launcher asked for torch's default)."""
    if ENV_STORE_BIND not in env or "MASTER_PORT" not in env:
        return None
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # env:// then connects instead of starting a server
    if env.get("RANK") != "0":
        return None
    bind = env[ENV_STORE_BIND] or WILDCARD
    sock = listen(bind, int(env["MASTER_PORT"]), "the worker store address")
    return serve(sock, timeout_s=WORKER_STORE_TIMEOUT_S)
