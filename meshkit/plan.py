"""The strategy planner: "this model, these GPUs, this network" -> the layouts that fit, ranked, with reasons.

Every combination of tp (within a node, dividing the heads), pp (dividing the layers), cp, ZeRO stage,
activation checkpointing and offload is costed with `estimate_memory`; those that fit in the GPU's memory
(with 10 % headroom) are ranked by a simple step-time model:

    step = compute · (1 + recompute) / (1 − bubble) + communication / link bandwidth

Communication per GPU per step: data-parallel gradient sync 2(n−1)/n · 2Ψ' (ZeRO-3: 1.5× that, for the
extra all-gather), tensor parallel 4 all-reduces of s·b·h per layer and micro-batch, pipeline sends of s·b·h
per micro-batch and stage boundary. The mesh puts tp innermost, then cp, dp, and pp outermost, so tp stays in a
node and pp is the first to cross the inter-node links. The model is coarse: it ranks layouts, it does not
predict step times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshkit.errors import MeshkitError
from meshkit.estimate import EstimateError, ModelShape, Recompute, estimate_memory

LINK_GBPS = {"nvlink": 300.0, "pcie": 25.0, "ib": 25.0, "ethernet": 3.0}  # GB/s per GPU, one direction
LATENCY_S = {"nvlink": 10e-6, "pcie": 20e-6, "ib": 20e-6, "ethernet": 50e-6}  # per message
GPU_TFLOPS = 300.0 * 0.4  # bf16 dense peak of a datacenter GPU at a typical 40 % utilisation
HEADROOM = 0.9
RECOMPUTE_COST = {"none": 0.0, "selective": 0.05, "full": 0.33}


class PlanError(MeshkitError):
    """Inputs the planner cannot use."""


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    gpu_mem_gb: float
    nodes: int = 1
    intra_node: str = "nvlink"
    inter_node: str = "ib"

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Layout:
    dp: int
    tp: int
    pp: int
    cp: int
    zero_stage: int
    microbatches: int
    activation_checkpointing: Recompute
    offload: str
    memory_gb: float = 0.0
    comm_gb: float = 0.0
    bubble: float = 0.0
    step_s: float = 0.0
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"cp{self.cp}", f"ZeRO-{self.zero_stage}"]
        parts.append(f"{'m' if self.pp > 1 else 'accum'}{self.microbatches}")
        if self.activation_checkpointing != "none":
            parts.append(f"AC {self.activation_checkpointing}")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        return " ".join(parts)

    def as_json(self) -> dict[str, Any]:
        keys = ("dp", "tp", "pp", "cp", "zero_stage", "microbatches", "activation_checkpointing", "offload")
        out = {key: getattr(self, key) for key in keys}
        out.update(memory_gb=self.memory_gb, comm_gb=self.comm_gb, bubble=self.bubble, reason=self.reason)
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _kind(cluster: Cluster, span: int) -> str:
    """The link a group whose ranks lie within `span` consecutive ranks uses."""
    return cluster.intra_node if span <= cluster.gpus_per_node else cluster.inter_node


def _link(cluster: Cluster, span: int) -> float:
    return LINK_GBPS[_kind(cluster, span)]


def _seconds(cluster: Cluster, span: int, volume: float, messages: float) -> float:
    kind = _kind(cluster, span)
    return volume / (LINK_GBPS[kind] * 1e9) + messages * LATENCY_S[kind]


def candidates(model: ModelShape, cluster: Cluster, seq_len: int, global_batch: int) -> list[Layout]:
    heads, layers = model.heads or 1, model.layers or 1
    out = []
    for tp in (t for t in _divisors(cluster.gpus_per_node) if heads % t == 0):
        for pp in (p for p in _divisors(cluster.gpus // tp) if p <= layers):
            for cp in (c for c in _divisors(cluster.gpus // (tp * pp)) if c == 1 or seq_len >= 16384):
                dp = cluster.gpus // (tp * pp * cp)
                if global_batch % dp:
                    continue
                microbatches = global_batch // dp  # micro-batches of one sequence: pipeline or accumulation
                if pp > 1 and microbatches < pp:
                    continue
                for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                    for recompute in ("none", "selective", "full"):
                        for offload in ("none", "cpu") if zero == 3 else ("none",):
                            out.append(Layout(dp, tp, pp, cp, zero, microbatches, recompute, offload))  # type: ignore[arg-type]
    return out


def cost(layout: Layout, model: ModelShape, cluster: Cluster, seq_len: int, global_batch: int, precision: str) -> None:
    """Fill memory, communication volume, bubble and modelled step time (micro-batches of one sequence)."""
    micro_batch = 1
    estimate = estimate_memory(
        model,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=precision,  # type: ignore[arg-type]
        zero_stage=layout.zero_stage,
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        activation_checkpointing=layout.activation_checkpointing,
        offload=layout.offload,  # type: ignore[arg-type]
    )
    layout.memory_gb = estimate.total_gb
    grads = 2 * model.params / (layout.tp * layout.pp)
    n = layout.dp * layout.cp
    dp_volume = (2 * (n - 1) / n * grads * (1.5 if layout.zero_stage == 3 else 1.0)) if n > 1 else 0.0
    sbh = seq_len / layout.cp * micro_batch * (model.hidden or 0) * 2
    steps = layout.microbatches
    tp_volume = 4 * 2 * (layout.tp - 1) / layout.tp * sbh * (model.layers or 0) / layout.pp * steps
    pp_volume = 2 * sbh * steps if layout.pp > 1 else 0.0
    layout.comm_gb = (dp_volume + tp_volume + pp_volume) / 1e9
    tp_span, cp_span = layout.tp, layout.tp * layout.cp
    pp_span = cluster.gpus if cluster.nodes > 1 else 1
    layers = (model.layers or 0) / layout.pp
    comm_s = (
        _seconds(cluster, cp_span * layout.dp, dp_volume, 2 * (n - 1) * (2 if layout.zero_stage == 3 else 1))
        + (_seconds(cluster, tp_span, tp_volume, 4 * layers * steps * 2 * (layout.tp - 1)) if layout.tp > 1 else 0)
        + (_seconds(cluster, pp_span, pp_volume, 2 * steps) if layout.pp > 1 else 0)
    )
    layout.bubble = (layout.pp - 1) / (layout.microbatches + layout.pp - 1) if layout.pp > 1 else 0.0
    flops = 6 * model.params * seq_len * global_batch / cluster.gpus
    compute_s = flops / (GPU_TFLOPS * 1e12) * (1 + RECOMPUTE_COST[layout.activation_checkpointing])
    layout.step_s = compute_s / (1 - layout.bubble) + comm_s + (0.2 * compute_s if layout.offload != "none" else 0)


def reason(layout: Layout, model: ModelShape, cluster: Cluster, fits_plain: bool) -> str:
    why = []
    if layout.tp == 1 and layout.pp == 1 and layout.zero_stage == 0 and layout.cp == 1:
        return "fits one GPU: plain DDP, one gradient all-reduce per step"
    if layout.tp > 1:
        layer_gb = 16 * (model.largest_layer_params or 0) / 1e9
        big = layer_gb > cluster.gpu_mem_gb * HEADROOM
        why.append(f"TP={layout.tp} inside a node" + (" (the largest layer does not fit one GPU)" if big else ""))
    if layout.pp > 1:
        crosses = cluster.nodes > 1 and cluster.inter_node == "ethernet"
        why.append(
            f"PP={layout.pp}" + (" across the slow inter-node links: only activations cross them" if crosses else "")
        )
    if layout.zero_stage:
        fast = _link(cluster, layout.tp * layout.cp * layout.dp) >= 25
        why.append(f"ZeRO-{layout.zero_stage}" + (" over fast links" if fast else " (sharding saves the memory)"))
    if layout.cp > 1:
        why.append(f"CP={layout.cp} for the {layout.cp}× shorter local sequence")
    if layout.activation_checkpointing != "none":
        why.append(f"{layout.activation_checkpointing} recompute to fit the activations")
    if layout.offload != "none":
        why.append("optimizer states offloaded to CPU")
    if not fits_plain and not why:
        why.append("the smallest memory")
    return "; ".join(why)


@dataclass
class Plan:
    fitting: list[Layout]
    smallest: Layout | None  # the layout needing the least memory (when nothing fits)
    suggestion: str = ""


def plan(model: ModelShape, cluster: Cluster, *, seq_len: int, global_batch: int, precision: str = "bf16") -> Plan:
    if cluster.intra_node not in ("nvlink", "pcie") or cluster.inter_node not in ("ib", "ethernet"):
        raise PlanError("--intra-node is nvlink or pcie; --inter-node is ib or ethernet")
    if cluster.gpus_per_node < 1 or cluster.nodes < 1 or cluster.gpu_mem_gb <= 0:
        raise PlanError("--gpus-per-node, --nodes and --gpu-mem-gb must be positive")
    if model.layers is None or model.hidden is None or model.heads is None:
        raise PlanError("the planner needs the model's shape: give --layers, --hidden and --heads (or a config)")
    layouts = candidates(model, cluster, seq_len, global_batch)
    if not layouts:
        raise PlanError(
            f"no layout divides global batch {global_batch} over {cluster.gpus} GPUs: change --global-batch"
        )
    for layout in layouts:
        try:
            cost(layout, model, cluster, seq_len, global_batch, precision)
        except EstimateError:
            layout.memory_gb = float("inf")
    budget = cluster.gpu_mem_gb * HEADROOM
    fitting = sorted((lay for lay in layouts if lay.memory_gb <= budget), key=lambda lay: lay.step_s)
    plain = any(lay.tp == lay.pp == 1 and lay.zero_stage == 0 for lay in fitting)
    for layout in fitting:
        layout.reason = reason(layout, model, cluster, plain)
    smallest = min(layouts, key=lambda lay: lay.memory_gb)
    result = Plan(fitting, smallest)
    if not fitting:
        need = smallest.memory_gb / HEADROOM
        more_nodes = _nodes_that_fit(model, cluster, seq_len, global_batch, precision)
        result.suggestion = (
            f"nothing fits in {cluster.gpu_mem_gb:g} GB per GPU: the smallest layout ({smallest.describe()}) needs "
            f"{smallest.memory_gb:.1f} GB; use GPUs with at least {need:.0f} GB"
            + (f", or {more_nodes} nodes" if more_nodes else "")
        )
    return result


def _nodes_that_fit(model: ModelShape, cluster: Cluster, seq_len: int, global_batch: int, precision: str) -> int:
    nodes = cluster.nodes
    while nodes < cluster.nodes * 64:
        nodes *= 2
        bigger = Cluster(cluster.gpus_per_node, cluster.gpu_mem_gb, nodes, cluster.intra_node, cluster.inter_node)
        batch = max(global_batch, bigger.gpus)
        for layout in candidates(model, bigger, seq_len, batch):
            try:
                cost(layout, model, bigger, seq_len, batch, precision)
            except EstimateError:
                continue
            if layout.memory_gb <= bigger.gpu_mem_gb * HEADROOM:
                return nodes
    return 0


def to_config(layout: Layout, cluster: Cluster, seq_len: int, global_batch: int, precision: str) -> dict[str, Any]:
    """The layout as a meshkit YAML mapping (`meshkit train` accepts it)."""
    sharded = layout.zero_stage == 3
    config: dict[str, Any] = {
        "launch": {"nproc_per_node": cluster.gpus_per_node, "nnodes": cluster.nodes},
        "parallel": {
            "dp_replicate": 1 if sharded else layout.dp,
            "dp_shard": layout.dp if sharded else 1,
            "tp": layout.tp,
            "pp": layout.pp,
            "cp": layout.cp,
        },
        "sharding": {"zero_stage": layout.zero_stage, **({"offload": "cpu"} if layout.offload == "cpu" else {})},
        "precision": "no" if precision == "fp32" else precision,
    }
    if layout.activation_checkpointing != "none":
        config["activation_checkpointing"] = {"mode": layout.activation_checkpointing}
    if layout.pp > 1:  # the pipeline splits each rank's batch into its micro-batches
        config["pipeline"] = {"microbatches": layout.microbatches}
        config["train"] = {"seq_len": seq_len, "micro_batch_size": layout.microbatches}
    else:  # gradient accumulation over micro-batches of one sequence
        config["grad_accum_steps"] = layout.microbatches
        config["train"] = {"seq_len": seq_len, "micro_batch_size": 1}
    return config
