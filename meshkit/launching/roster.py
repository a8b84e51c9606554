"""Which nodes of a job are alive: each launcher beats a counter in the rendezvous store once a second.

A count of arrivals says nothing about a node that arrived and later died; counters that stop moving do.
Freshness is judged by this node's own clock (when it last saw a counter change), so clocks that differ
between machines do not matter.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore

BEAT_S = 1.0
STALE_S = 5.0  # a counter unchanged this long belongs to a node that is gone


class NodeRoster:
    """Beat for this node; watch the others' beats (own client connection, off the agent's)."""

    def __init__(self, host: str, port: int, run_id: str, node_rank: int, nnodes: int) -> None:
        self.node_rank, self.nnodes = node_rank, nnodes
        self._address = (host, port, f"meshkit/{run_id}/roster")
        self._last_value: dict[int, int] = {}
        self._last_change: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshkit-node-roster", daemon=True)

    def __enter__(self) -> NodeRoster:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_S + 5)

    def _run(self) -> None:
        host, port, prefix = self._address
        try:
            store = PrefixStore(prefix, TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10)))
        except (RuntimeError, ValueError):
            return
        while True:
            with contextlib.suppress(RuntimeError, ValueError):  # node 0's store may be gone at the end
                store.add(f"beat/{self.node_rank}", 1)
                self._observe(store)
            if self._stop.wait(BEAT_S):
                return

    def _observe(self, store: PrefixStore) -> None:
        now = time.monotonic()
        keys = [f"beat/{node}" for node in range(self.nnodes)]
        for node, key in enumerate(keys):
            if not store.check([key]):
                continue
            value = int(store.get(key))
            with self._lock:
                if self._last_value.get(node) != value:
                    self._last_value[node], self._last_change[node] = value, now

    def status(self) -> tuple[list[int], dict[int, float]]:
        """(nodes alive, {node: seconds since its last beat} for nodes that joined and went silent)."""
        now = time.monotonic()
        with self._lock:
            seen = dict(self._last_change)
        alive = sorted(node for node, at in seen.items() if now - at < STALE_S)
        silent = {node: now - at for node, at in sorted(seen.items()) if now - at >= STALE_S}
        return alive, silent

    def describe(self, expected: str) -> str:
        """'expected 2 nodes, 1 alive (node 1 stopped responding 14 s ago)'."""
        alive, silent = self.status()
        gone = ", ".join(f"node {node} stopped responding {age:.0f} s ago" for node, age in silent.items())
        return f"expected {expected} nodes, {len(alive)} alive" + (f" ({gone})" if gone else "")
