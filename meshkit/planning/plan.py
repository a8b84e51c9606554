"""The strategy planner: "this model, these GPUs, this network" -> the layouts that fit, ranked by predicted
step time, with tokens/s, MFU and reasons.

Every combination of tp (within a node, dividing the heads), pp (dividing the layers; 1 or more model chunks
per rank), cp, ep (a mixture of experts: dividing its experts and dp·cp; ZeRO-0 or 3), ZeRO stage, activation
checkpointing and offload is costed with `estimate_memory`; those that fit in the GPU's memory (with 10 % headroom)
are ranked by `perf_model.predict`: compute, recomputation, pipeline bubble, exposed communication per collective
and link class, optimizer and offload time. Device and links: a preset (`--gpu`), a profile, or the link flags.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from meshkit.config.layout import Layout
from meshkit.core.errors import MeshkitError
from meshkit.planning.estimate import (
    Estimate,
    EstimateError,
    ModelShape,
    Optimizer,
    Precision,
    Reference,
    estimate_memory,
)
from meshkit.planning.hardware import PRESETS, Hardware
from meshkit.planning.perf_model import StepTime, Topology, all_to_all_bytes, data_parallel_bytes, predict
from meshkit.planning.step_recipe import StepRecipe

HEADROOM = 0.9
INTRA_LINKS = ("nvlink", "nvlink4", "pcie")
INTER_LINKS = ("ib", "ib-ndr", "ethernet")


class PlanError(MeshkitError):
    """Inputs the planner cannot use."""


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    gpu_mem_gb: float
    nodes: int = 1
    intra_node: str | None = None  # a link class of `hardware.LINKS`; None: the device's own
    inter_node: str | None = None
    device: Hardware | None = None  # None: an A100-class GPU (the `a100` preset)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def hardware(self) -> Hardware:
        return (self.device or PRESETS["a100"]).with_links(self.intra_node, self.inter_node)

    def link_name(self, inter: bool) -> str:
        named = self.inter_node if inter else self.intra_node
        return named or f"{self.hardware.name} {'inter' if inter else 'intra'}-node link"

    @property
    def slow_between_nodes(self) -> bool:
        """More than one node, joined by links slower than 10 GB/s per device (ethernet)."""
        return self.nodes > 1 and self.hardware.inter_gbps < 10

    def topology(self) -> Topology:
        return Topology(self.gpus_per_node, self.nodes)


STRATEGIES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}


@dataclass(frozen=True)
class LayoutFilter:
    """What the user fixed (`meshkit plan --strategy zero3 --tp 1 ...`): `Layout` field -> the value it must have
    (the layout itself stays `config.layout.Layout`'s to model)."""

    fixed: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, strategy: str | None = None, **fixed: Any) -> LayoutFilter:
        if strategy is not None and strategy.lower() not in STRATEGIES:
            raise PlanError(f"--strategy {strategy}: choose one of {', '.join(STRATEGIES)}")
        stage = {"zero_stage": STRATEGIES[strategy.lower()]} if strategy is not None else {}
        return cls(tuple({**stage, **{k: v for k, v in fixed.items() if v is not None}}.items()))

    def admits(self, layout: Layout) -> bool:
        return all(getattr(layout, name) == wanted for name, wanted in self.fixed)

    def describe(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.fixed) or "any"


@dataclass
class PlannedLayout:
    """A layout the planner costed: the layout itself and what the models predict for it."""

    layout: Layout
    memory_gb: float = 0.0
    comm_gb: float = 0.0
    bubble: float = 0.0
    reason: str = ""
    time: StepTime | None = None
    estimate: Estimate | None = None  # the memory terms behind memory_gb (`meshkit plan --explain`)
    host_gb_per_node: float = 0.0  # offloaded states a node's host memory holds for its ranks
    tied: bool = False  # within TIE of the fastest: ranked by simplicity, not by time (`rank`)

    @property
    def step_s(self) -> float:
        return self.time.step_s if self.time is not None else 0.0

    def describe(self) -> str:
        return self.layout.summary()

    def as_json(self) -> dict[str, Any]:
        out = self.layout.as_json()
        out.update(memory_gb=self.memory_gb, comm_gb=self.comm_gb, bubble=self.bubble, reason=self.reason)
        out["host_gb_per_node"] = self.host_gb_per_node
        if self.time is not None:
            out.update(step_s=self.step_s, tokens_per_s=self.time.tokens_per_s, mfu=self.time.mfu)
            out["breakdown"] = {k: v for k, v in self.time.as_json().items() if k not in ("tokens_per_s", "mfu")}
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
                chunks = [v for v in (1, 2, 4) if v == 1 or (layers >= pp * v and microbatches % pp == 0)]
                for ep in expert_parallel_sizes(model, dp * cp):
                    for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                        for recompute in ("none", "selective", "full"):
                            for offload in ("none", "cpu") if zero == 3 else ("none",):
                                for v in chunks if pp > 1 else [1]:
                                    out.append(
                                        Layout.planned(dp, tp, pp, cp, zero, microbatches, recompute, offload, v, ep)
                                    )
    return out


def expert_parallel_sizes(model: ModelShape, token_ranks: int) -> list[int]:
    """ep sizes to try: 1, and for a mixture of experts every size dividing both its experts and dp·cp."""
    return [ep for ep in _divisors(token_ranks) if ep == 1 or (model.experts and model.experts % ep == 0)]


def cost(
    layout: Layout,
    model: ModelShape,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    precision: Precision,
    optimizer: Optimizer = "adam",
    runtime_gb: float = 0.0,
    reference: Reference = "none",
    recipe: StepRecipe | None = None,
) -> PlannedLayout:
    """Memory, communication volume, bubble and modelled step time (micro-batches of one sequence); `reference`:
    preference training's reference model (a frozen copy costs the weights' memory again; a copy or the base with
    adapters off, a forward over the step's rows)."""
    micro_batch = 1
    estimate = estimate_memory(
        model,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=precision,
        optimizer=optimizer,
        zero_stage=layout.zero_stage,
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        activation_checkpointing=layout.activation_checkpointing,
        offload=layout.offload,
        ep=layout.ep,
        runtime_gb=runtime_gb,
        reference=reference,
        recipe=recipe,
    )
    grads = 2 * sum(model.local_params(layout.tp, layout.pp, layout.ep))
    n = layout.dp * layout.cp
    steps = layout.microbatches
    dp_volume = data_parallel_bytes(grads, n, layout.zero_stage, steps)
    sbh = seq_len / layout.cp * micro_batch * (model.hidden or 0) * 2
    tp_volume = 4 * 2 * (layout.tp - 1) / layout.tp * sbh * (model.layers or 0) / layout.pp * steps
    pp_volume = 2 * sbh * steps * layout.stages_per_rank if layout.pp > 1 else 0.0
    per_layer = all_to_all_bytes(model, layout, seq_len=seq_len, micro_batch=micro_batch, act_b=2)
    ep_volume = per_layer * model.moe_layers / layout.pp * steps
    bubble = (layout.pp - 1) / (layout.stages_per_rank * layout.microbatches + layout.pp - 1) if layout.pp > 1 else 0.0
    time = predict(
        model, layout, cluster.topology(), cluster.hardware,
        seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch, precision=precision, optimizer=optimizer,
        reference=reference,
    )  # fmt: skip
    volume = dp_volume + tp_volume + pp_volume + ep_volume
    host = estimate.host_gb * min(cluster.gpus_per_node, cluster.gpus)
    return PlannedLayout(layout, estimate.total_gb, volume / 1e9, bubble, time=time, estimate=estimate,
                         host_gb_per_node=host)  # fmt: skip


def reason(layout: Layout, model: ModelShape, cluster: Cluster, fits_plain: bool, recompute_needed: bool = True) -> str:
    why = []
    if layout.tp == 1 and layout.pp == 1 and layout.zero_stage == 0 and layout.cp == 1:
        return "fits one GPU: plain DDP, one gradient all-reduce per step"
    if layout.tp > 1:
        layer_gb = 16 * (model.largest_layer_params or 0) / 1e9
        big = layer_gb > cluster.gpu_mem_gb * HEADROOM
        why.append(f"TP={layout.tp} inside a node" + (" (the largest layer does not fit one GPU)" if big else ""))
    if layout.pp > 1:
        crosses = cluster.slow_between_nodes
        why.append(
            f"PP={layout.pp}" + (" across the slow inter-node links: only activations cross them" if crosses else "")
        )
    if layout.zero_stage:
        span = layout.tp * layout.cp * layout.dp
        hardware = cluster.hardware
        fast = (hardware.intra_gbps if cluster.topology().link(span) == "intra" else hardware.inter_gbps) >= 25
        why.append(f"ZeRO-{layout.zero_stage}" + (" over fast links" if fast else " (sharding saves the memory)"))
    if layout.cp > 1:
        why.append(f"CP={layout.cp} for the {layout.cp}× shorter local sequence")
    if layout.ep > 1:
        why.append(f"EP={layout.ep}: each rank holds 1/{layout.ep} of the experts, tokens sent by all-to-all")
    if layout.activation_checkpointing != "none":
        fit = "to fit the activations" if recompute_needed else "(it fits without: not needed)"
        why.append(f"{layout.activation_checkpointing} recompute {fit}")
    if layout.offload != "none":
        why.append("optimizer states offloaded to CPU")
    if not fits_plain and not why:
        why.append("the smallest memory")
    return "; ".join(why)


TIE = 0.05  # predicted times this close are within the model's error: the simpler layout goes first
_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


def simplicity(layout: Layout) -> tuple[int, ...]:
    """Fewer model-parallel ranks, a lower ZeRO stage, less recomputation, no offload, fewer chunks first."""
    recompute = _RECOMPUTE_ORDER[layout.activation_checkpointing]
    return (
        layout.tp * layout.pp * layout.cp * layout.ep,
        layout.zero_stage,
        recompute,
        layout.offload != "none",
        layout.stages_per_rank,
    )


def rank(layouts: Iterable[PlannedLayout]) -> list[PlannedLayout]:
    """Fastest first, except that among the layouts within TIE of the fastest the simplest leads (those are
    marked `tied`, so a table can say why their times are not in order)."""
    by_time = sorted(layouts, key=lambda lay: lay.step_s)
    if not by_time:
        return []
    near = [lay for lay in by_time if lay.step_s <= by_time[0].step_s * (1 + TIE)]
    for planned in near:
        planned.tied = len(near) > 1
    return sorted(near, key=lambda lay: simplicity(lay.layout)) + by_time[len(near) :]


@dataclass
class Plan:
    fitting: list[PlannedLayout]
    smallest: PlannedLayout | None  # the layout needing the least memory (when nothing fits)
    suggestion: str = ""
    budget_gb: float = 0.0  # what a layout may use per GPU (memory × HEADROOM)
    dropped: list[PlannedLayout] = field(default_factory=list)  # costed, over a limit, least memory first


def over_limit(planned: PlannedLayout, budget_gb: float, host_limit_gb: float | None) -> str | None:
    """Why `planned` does not fit, naming the limit and its largest term; None when it fits."""
    if planned.memory_gb > budget_gb:
        biggest = max(planned.estimate.lines, key=lambda line: line.gb) if planned.estimate else None
        term = f" (largest term: {biggest.name} {biggest.gb:.1f} GB)" if biggest else ""
        return f"{planned.memory_gb:.2f} GB > the {budget_gb:.1f} GB per-GPU limit{term}"
    if host_limit_gb is not None and planned.host_gb_per_node > host_limit_gb:
        return f"offloaded states {planned.host_gb_per_node:.0f} GB > {host_limit_gb:g} GB of host memory per node"
    return None


def plan(
    model: ModelShape,
    cluster: Cluster,
    *,
    seq_len: int,
    global_batch: int,
    precision: Precision = "bf16",
    optimizer: Optimizer = "adam",
    only: LayoutFilter | None = None,
    runtime_gb: float = 0.0,
    host_mem_gb: float | None = None,
    reference: Reference = "none",
    recipe: StepRecipe | None = None,
) -> Plan:
    """Every layout that fits, fastest first; `optimizer` (adam, adam8bit, adam4bit, sgd) sets the state bytes and step
    traffic per parameter. `only` keeps the layouts the user fixed; `runtime_gb` is counted on every GPU (the
    CUDA context, communication buffers); `host_mem_gb` limits what offload puts in a node's host memory;
    `reference`: preference training's reference model, `recipe`: how the step runs (`estimate_memory`)."""
    if cluster.intra_node not in (None, *INTRA_LINKS) or cluster.inter_node not in (None, *INTER_LINKS):
        raise PlanError(
            f"--intra-node is one of {', '.join(INTRA_LINKS)}; --inter-node one of {', '.join(INTER_LINKS)}"
        )
    if cluster.gpus_per_node < 1 or cluster.nodes < 1 or cluster.gpu_mem_gb <= 0:
        raise PlanError("--gpus-per-node, --nodes and --gpu-mem-gb must be positive")
    if model.layers is None or model.hidden is None or model.heads is None:
        raise PlanError("the planner needs the model's shape: give --layers, --hidden and --heads (or a config)")
    layouts = candidates(model, cluster, seq_len, global_batch)
    if not layouts:
        raise PlanError(
            f"no layout divides global batch {global_batch} over {cluster.gpus} GPUs: change --global-batch"
        )
    if only is not None:
        layouts = [layout for layout in layouts if only.admits(layout)]
        if not layouts:
            raise PlanError(
                f"no layout of {cluster.gpus} GPUs has {only.describe()} (tp within a node dividing the "
                f"{model.heads} heads, pp up to the {model.layers} layers, cp for sequences of 16k+): loosen them"
            )
    costed = []
    for layout in layouts:
        try:
            costed.append(
                cost(layout, model, cluster, seq_len, global_batch, precision, optimizer, runtime_gb, reference, recipe)
            )
        except EstimateError:
            costed.append(PlannedLayout(layout, memory_gb=float("inf")))
    budget = cluster.gpu_mem_gb * HEADROOM
    fitting = rank(lay for lay in costed if over_limit(lay, budget, host_mem_gb) is None)
    plain = any(lay.layout.tp == lay.layout.pp == 1 and lay.layout.zero_stage == 0 for lay in fitting)
    fits = {lay.layout for lay in fitting}
    for planned in fitting:
        without = replace(planned.layout, activation_checkpointing="none")
        needed = without not in fits  # (the same layout without recomputation does not fit, or is no candidate)
        planned.reason = reason(planned.layout, model, cluster, plain, needed)
    smallest = min(costed, key=lambda lay: lay.memory_gb)
    dropped = sorted((lay for lay in costed if over_limit(lay, budget, host_mem_gb)), key=lambda lay: lay.memory_gb)
    result = Plan(fitting, smallest, budget_gb=budget, dropped=dropped)
    if not fitting:
        need = smallest.memory_gb / HEADROOM
        more_nodes = 0 if only else _nodes_that_fit(model, cluster, seq_len, global_batch, precision, optimizer)
        why = over_limit(smallest, budget, host_mem_gb)
        result.suggestion = (
            f"nothing{'' if only is None else f' with {only.describe()}'} fits in {cluster.gpu_mem_gb:g} GB per GPU: "
            f"the smallest layout ({smallest.describe()}) needs {why}, the limit being {HEADROOM:.0%} of the GPU; "
            f"use GPUs with at least {need:.0f} GB" + (f", or {more_nodes} nodes" if more_nodes else "")
        )
    return result


def _nodes_that_fit(
    model: ModelShape, cluster: Cluster, seq_len: int, global_batch: int, precision: Precision, optimizer: Optimizer
) -> int:
    nodes = cluster.nodes
    while nodes < cluster.nodes * 64:
        nodes *= 2
        bigger = replace(cluster, nodes=nodes)
        batch = max(global_batch, bigger.gpus)
        for layout in candidates(model, bigger, seq_len, batch):
            try:
                planned = cost(layout, model, bigger, seq_len, batch, precision, optimizer)
            except EstimateError:
                continue
            if planned.memory_gb <= bigger.gpu_mem_gb * HEADROOM:
                return nodes
    return 0


def to_config(layout: Layout, cluster: Cluster, seq_len: int, global_batch: int, precision: str) -> dict[str, Any]:
    """The layout as a meshkit YAML mapping (`meshkit train` accepts it)."""
    config: dict[str, Any] = {
        "launch": {"nproc_per_node": cluster.gpus_per_node, "nnodes": cluster.nodes},
        "parallel": {name: getattr(layout, name) for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp")}
        | ({"ep": layout.ep} if layout.ep > 1 else {}),
        "sharding": {"zero_stage": layout.zero_stage, **({"offload": "cpu"} if layout.offload == "cpu" else {})},
        "precision": "no" if precision == "fp32" else precision,
    }
    if layout.activation_checkpointing != "none":
        config["activation_checkpointing"] = {"mode": layout.activation_checkpointing}
    if layout.pp > 1:  # the pipeline splits each rank's batch into its micro-batches
        config["pipeline"] = {"microbatches": layout.microbatches}
        if layout.stages_per_rank > 1:
            config["pipeline"].update(schedule="interleaved_1f1b", stages_per_rank=layout.stages_per_rank)
        config["train"] = {"seq_len": seq_len, "micro_batch_size": layout.microbatches}
    else:  # gradient accumulation over micro-batches of one sequence
        config["grad_accum_steps"] = layout.microbatches
        config["train"] = {"seq_len": seq_len, "micro_batch_size": 1}
    return config
