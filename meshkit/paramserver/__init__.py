"""The parameter-server strategy (`strategy: parameter_server`).

Ranks `0..ps.servers-1` hold the trainable parameters, split across them by size, each with the user's optimizer
over its share; the other ranks are workers: they compute gradients on their part of the data, push them to the
servers and pull the updated parameters back. The servers apply gradients under one rule, stale-synchronous
parallel: a worker's pull is answered once every live worker has pushed the gradients of all steps more than
`max_staleness` behind it. `mode: sync` is the bound 0 (every step waits for every worker: DDP's weights);
`mode: async` runs workers up to `max_staleness` steps apart (unbounded: Downpour-style).

The traffic is point-to-point over a gloo group of its own (also under NCCL runs: servers are CPU-side
processes, and gloo can tell a dead peer from a slow one), one receiving thread per worker on each server, so a
dead worker is noticed when its connection closes and never blocks the others.
"""

from meshkit.paramserver.roles import ParameterServerError, Roles, check_parameter_server

__all__ = ["ParameterServerError", "Roles", "check_parameter_server"]
