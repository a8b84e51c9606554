"""The parameter server in numbers: memory of a server and of a worker, traffic per step against ring all-reduce,
and when a parameter server is worth it (`meshkit estimate --ps-servers`, `meshkit plan`).

Parameters are served in their own dtype (fp32 under autocast), so 4 bytes per element travel. Each step a worker
pushes its gradients (Ψ elements) and pulls the parameters (Ψ): 2Ψ per worker, and each of S servers carries
2Ψ·W/S for W workers. Ring all-reduce moves 2Ψ(N-1)/N per rank, spread over every rank's link: a parameter server
moves more, through fewer links — it pays off where waiting, not volume, is the cost: ranks of different speed
(a synchronous step waits for the slowest), slow or shared links (an asynchronous worker does not wait for a
slow push of another), many small workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshkit.config.layout import Recompute
from meshkit.planning.estimate import (
    GB,
    Estimate,
    Line,
    ModelShape,
    Optimizer,
    Precision,
    estimate_memory,
    model_state_bytes,
)
from meshkit.planning.plan import Cluster

ELEMENT = 4  # bytes of a served element (parameters keep their dtype, fp32 under autocast)


def server_memory(model: ModelShape, optimizer: Optimizer, servers: int, workers: int) -> Estimate:
    """One server: its share of the weights and optimizer states, and the gradients waiting for its step (all W
    of them in sync mode, where every worker's gradient arrives before the step)."""
    weight_b, _, optim_b = model_state_bytes("fp32", optimizer)
    share = model.params / servers
    psi = f"Ψ/S={share:.4g}"
    return Estimate(
        [
            Line("params", weight_b * share / GB, f"{weight_b}·{psi}"),
            Line("optimizer", optim_b * share / GB, f"{optim_b}·{psi}"),
            Line("grads", workers * ELEMENT * share / GB, f"W={workers} waiting gradients: {workers}·{ELEMENT}·{psi}"),
            Line(
                "buffers", 2 * ELEMENT * share / GB, f"the summed gradient and the parameters sent: 2·{ELEMENT}·{psi}"
            ),
        ]
    )


def worker_memory(
    model: ModelShape, *, seq_len: int, micro_batch: int, precision: Precision, activation_checkpointing: Recompute
) -> Estimate:
    """One worker: the whole model and its gradients, no optimizer state, the flat buffers it sends and receives."""
    plain = estimate_memory(
        model,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
    )
    activations = next(line for line in plain.lines if line.name == "activations")
    psi = f"Ψ={model.params:.4g}"
    return Estimate(
        [
            Line("params", ELEMENT * model.params / GB, f"{ELEMENT}·{psi}"),
            Line("grads", ELEMENT * model.params / GB, f"{ELEMENT}·{psi}"),
            Line("optimizer", 0.0, "on the servers"),
            activations,
            Line("buffers", 2 * ELEMENT * model.params / GB, f"gradients pushed, parameters pulled: 2·{ELEMENT}·{psi}"),
        ]
    )


@dataclass(frozen=True)
class Traffic:
    per_worker_gb: float  # pushed + pulled by one worker per step
    per_server_gb: float  # through one server's link per step
    ring_per_rank_gb: float  # ring all-reduce per rank, the same world as DDP

    def as_json(self) -> dict[str, float]:
        return {
            "per_worker_gb": self.per_worker_gb,
            "per_server_gb": self.per_server_gb,
            "ring_allreduce_per_rank_gb": self.ring_per_rank_gb,
        }


def traffic(model: ModelShape, servers: int, workers: int) -> Traffic:
    world = servers + workers
    volume = ELEMENT * model.params
    return Traffic(2 * volume / GB, 2 * volume * workers / servers / GB, 2 * volume * (world - 1) / world / GB)


def advice(model: ModelShape, cluster: Cluster, stragglers: bool) -> str:
    """One paragraph: does a parameter server (sync or async) help on this cluster, and why."""
    world = cluster.gpus
    servers = max(1, cluster.nodes)  # one server per node spreads the servers' traffic over every node's link
    moved = traffic(model, servers, world - servers)
    hardware = cluster.hardware
    link = hardware.inter_gbps if cluster.nodes > 1 else hardware.intra_gbps
    server_s, ring_s = moved.per_server_gb / link, moved.ring_per_rank_gb / link
    volumes = (
        f"{servers} server(s) would each carry {moved.per_server_gb:.2f} GB per step (~{server_s:.3f} s on "
        f"{cluster.link_name(cluster.nodes > 1)}), ring all-reduce "
        f"{moved.ring_per_rank_gb:.2f} GB per rank (~{ring_s:.3f} s)"
    )
    reasons = []
    if stragglers:
        reasons.append("ranks of different speed: a synchronous step waits for the slowest")
    if cluster.slow_between_nodes:
        reasons.append("slow or shared links between nodes: an asynchronous worker does not wait for another's push")
    if world >= 32 and model.params * 16 < cluster.gpu_mem_gb * GB / 4:
        reasons.append("many workers on a model that fits one device: no global barrier every step")
    if reasons:
        return (
            f"parameter server: worth trying strategy=parameter_server with ps.mode=async, ps.max_staleness=2 "
            f"({'; '.join(reasons)}); {volumes}. Measured on a straggler in BENCHMARKS.md (bench/ps.py)."
        )
    return (
        f"parameter server: not advised here (equal ranks, fast links: all-reduce spreads the traffic over every "
        f"link and keeps every rank's weights equal); {volumes}. Pass --stragglers if some ranks are slower."
    )
