"""Predicted step time of a layout: compute, recomputation, pipeline bubble, exposed communication per collective
and link class, optimizer and offload; then tokens/s and MFU.

FLOPs per token follow Narayanan et al. 2021 (arXiv 2104.04473, eq. 3) generalised to any block: 6 per block
parameter (forward 2, backward 4), 12·l·s·h for attention scores and values, 6·V·h for the output head. Full
recomputation repeats the blocks' forward (+1/3 of their FLOPs), selective only the attention core (4·l·s·h).
MFU counts model FLOPs only (no recomputation), as PaLM (Chowdhery et al. 2022) defines it.

The mesh puts tp innermost, then cp, dp and pp outermost (`meshkit.runtime.mesh`); a group whose ranks lie within one
node uses the intra-node link, else the inter-node one. Ring collectives: all-reduce moves 2(n−1)/n of the
bytes, all-gather / reduce-scatter (n−1)/n, each with n−1 (or 2(n−1)) latency steps. What overlaps:

- DDP and ZeRO-1/2 without pipeline: the gradients are reduced in buckets during the last micro-step's
  backward (ZeRO-2: every micro-step's, each bucket reduced to its owner); only what outlasts that backward, or
  the last bucket, is exposed. Pipelines reduce after the last backward: fully exposed. ZeRO-1/2 all-gather
  the updated chunks after the step.
- ZeRO-3 (FSDP): each block's all-gather is prefetched during the previous block's compute, every micro-step,
  forward and backward; the reduce-scatter runs once per step during the last backward. Exposed: what
  outlasts the compute it hides behind, plus the first block's gather.
- Tensor / sequence parallel: per layer and micro-batch, 2 all-reduces of s·b·h forward (4 with full
  recomputation) and one backward per column-parallel linear (q, k, v, gate, up: 5), on the critical path
  (measured on the reference GPT: 8 per layer with the loss's).
- Pipeline: one activation send and one gradient send per micro-batch and stage (×v chunks when interleaved),
  on the critical path.
- Measured profiles (`layout: auto`) add what the model's own block reaches of the matmul rate
  (`matmul_efficiency`) and, per tp degree, what splitting a block costs beyond its share and these all-reduces
  (`Hardware.tp_overhead_s`: dispatch of the split tensors, waiting for peers). Ranks sharing a device run a
  pipeline of pp / ranks_per_device devices' worth of stages: only that pipeline's ramp is lost.
- Context parallel (ring attention): K and V travel the ring (cp − 1 steps, dK/dV too in backward), each step
  hidden behind the attention of the block it arrived with.
- Expert parallel: per MoE layer and micro-batch, four all-to-alls of the routed copies (k·s·b·h, of which
  (ep − 1)/ep leave the rank): dispatch and combine, forward and backward (forward again under full
  recomputation), on the critical path. The busiest ep rank's experts compute `expert_imbalance` × the mean
  (the most tokens one rank's experts receive over the mean; `bench/moe.py` measures it). Expert gradients are
  reduced over the dp·cp/ep ranks that hold the same experts. The router's balancing loss under pp runs one
  forward-only pass of the step through the pipeline first (its compute, bubble and all-to-alls).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from meshkit.config.layout import Layout
from meshkit.planning.estimate import ModelShape, Optimizer, Precision, model_state_bytes
from meshkit.planning.hardware import Hardware

# bytes an optimizer step moves per parameter: read the gradient, read+write the fp32 master and the states,
# write the low-precision copy (AdamW: two fp32 moments; 8-bit AdamW: two 1-byte moments; 4-bit: two half-bytes;
# SGD: one momentum)
OPTIMIZER_BYTES_PER_PARAM = {"adam": 30, "adam8bit": 16, "adam4bit": 14, "sgd": 22}
HOST_MEMORY_GBPS = 50.0  # a CPU optimizer's share of host memory bandwidth
DDP_BUCKET_BYTES = 25 * 2**20
TP_BACKWARD_REDUCES = 5  # column-parallel linears per block whose input gradients are all-reduced (q, k, v, gate, up)
EXPERT_IMBALANCE = 1.2  # busiest ep rank's routed tokens over the mean, when nothing measured says otherwise


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    nodes: int

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def link(self, span: int) -> str:
        return "intra" if span <= self.gpus_per_node or self.nodes == 1 else "inter"


@dataclass
class StepTime:
    compute_s: float
    recompute_s: float
    bubble_s: float
    optimizer_s: float
    offload_s: float
    overhead_s: float = 0.0  # measured host dispatch and peer waits of tensor parallel (`Hardware.tp_overhead_s`)
    reference_s: float = 0.0  # preference training: the reference model's forward over the step's rows
    comm_s: dict[str, float] = field(default_factory=dict)  # exposed seconds per collective
    comm_link: dict[str, str] = field(default_factory=dict)  # intra / inter per collective
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def flops_per_token(model: ModelShape, seq_len: int) -> tuple[float, float, float]:
    """(block FLOPs, attention-core FLOPs, head FLOPs) per token, forward + backward."""
    layers, hidden, vocab = model.layers or 0, model.hidden or 0, model.vocab or 0
    block_params = layers * (model.largest_layer_params or 0) or max(0.0, model.params - 2 * vocab * hidden)
    block_params -= model.expert_params * (1.0 - model.active_expert_fraction)  # MoE: only top-k experts compute
    return 6 * block_params, 12 * layers * seq_len * hidden, 6 * vocab * hidden


def _ring(volume: float, ranks: int, gbps: float, latency: float, kind: str) -> float:
    """Seconds of one ring collective over `ranks` on a link of `gbps` (kind: all_reduce or gather)."""
    if ranks <= 1 or volume <= 0:
        return 0.0
    factor, steps = (
        (2 * (ranks - 1) / ranks, 2 * (ranks - 1)) if kind == "all_reduce" else ((ranks - 1) / ranks, ranks - 1)
    )
    return factor * volume / (gbps * 1e9) + steps * latency


def data_parallel_bytes(grads: float, ranks: int, zero_stage: int, microbatches: int) -> float:
    """Bytes one rank moves over the data-parallel ranks in an optimizer step of `microbatches` micro-steps
    (`grads`: its 16-bit gradient bytes, the size of its 16-bit weights too). DDP and ZeRO-1: one all-reduce at the
    window's end (2·(n-1)/n); ZeRO-2: a reduce-scatter every micro-step (meshkit's default under accumulation) and
    the all-gather of the updated weights; ZeRO-3: a forward and a backward all-gather of the weights every
    micro-step and the reduce-scatter of the window's gradients."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks * grads  # one all-gather or one reduce-scatter
    if zero_stage == 3:
        return share * (2 * microbatches + 1)
    if zero_stage == 2:
        return share * (microbatches + 1)
    return 2 * share


def all_to_all_bytes(model: ModelShape, layout: Layout, *, seq_len: int, micro_batch: int, act_b: int) -> float:
    """Bytes one rank sends in one MoE layer's expert-parallel all-to-alls for one micro-batch (forward and
    backward; the routed copies bound for other ranks)."""
    if layout.ep == 1 or not model.moe_layers:
        return 0.0
    routed = model.top_k * seq_len / layout.cp * micro_batch * (model.hidden or 0) * act_b
    passes = 6 if layout.activation_checkpointing == "full" else 4
    return passes * routed * (layout.ep - 1) / layout.ep


def tp_layer_comm(
    hardware: Hardware,
    topology: Topology,
    layout: Layout,
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    precision: Precision = "bf16",
) -> float:
    """Seconds of tensor parallel's all-reduces for one block and one micro-batch: forward, the attention and MLP
    outputs (twice with full recomputation); backward, the input gradient of every column-parallel linear (q, k,
    v, and gate/up or the first MLP linear), each its own all-reduce of s·b·h."""
    act_b = 4 if precision == "fp32" else 2
    sbh = seq_len / layout.cp * micro_batch * hidden * act_b
    forward = 4 if layout.activation_checkpointing == "full" else 2
    link = topology.link(layout.tp)
    gbps = hardware.intra_gbps if link == "intra" else hardware.inter_gbps
    latency = hardware.intra_latency_s if link == "intra" else hardware.inter_latency_s
    return _ring(sbh, layout.tp, gbps, latency, "all_reduce") * (forward + TP_BACKWARD_REDUCES)


def predict(
    model: ModelShape,
    layout: Layout,
    topology: Topology,
    hardware: Hardware,
    *,
    seq_len: int,
    global_batch: int,
    micro_batch: int = 1,
    precision: Precision = "bf16",
    optimizer: Optimizer = "adam",
    expert_imbalance: float = EXPERT_IMBALANCE,
    reference: str = "none",
) -> StepTime:
    """Seconds per optimizer step of `global_batch` sequences of `seq_len` tokens on this layout; `reference`
    (preference training): a frozen copy or the base with adapters off runs a forward over the same rows (a third
    of a training pass, and its share of a pipeline's bubble); a precomputed one, nothing."""
    gpus = topology.gpus
    weight_b, grad_b, _ = model_state_bytes(precision, "adam")
    act_b = 4 if precision == "fp32" else 2
    hidden, layers = model.hidden or 0, model.layers or 1
    tokens = global_batch * seq_len
    blocks, attention, head = flops_per_token(model, seq_len)
    rate = hardware.peak_tflops * 1e12 * hardware.matmul_efficiency
    model_flops = (blocks + attention + head) * tokens
    compute = model_flops / gpus / rate
    if layout.ep > 1:  # the busiest rank's experts set the pace
        expert_flops = 6 * model.expert_params * model.active_expert_fraction * tokens
        compute += (expert_imbalance - 1) * expert_flops / gpus / rate
    extra = {"full": (blocks + attention) / 3, "selective": attention / 3}.get(layout.activation_checkpointing, 0.0)
    recompute = extra * tokens / gpus / rate
    m, v, pp = layout.microbatches, layout.stages_per_rank, layout.pp
    # ranks sharing a device (CPU ranks over fewer cores) run a pipeline of pp / shared devices' worth of
    # stages: an idle rank's share goes to a busy one, so only that shorter pipeline's ramp is lost
    devices = max(1.0, pp / hardware.ranks_per_device)
    bubble = (devices - 1) / (v * m) * (compute + recompute) if pp > 1 else 0.0
    counting = pp > 1 and model.router_loss and model.moe_layers > 0
    if counting:  # the balancing loss under pp: a forward-only pass of the step counts the routing first
        recompute += compute / 3
        bubble += (devices - 1) / (v * m) * compute / 3
    per_micro = (compute + recompute) / m  # one micro-batch's forward + backward on this device
    backward_last = per_micro * 2 / 3

    def seconds(span: int, volume: float, ranks: int, kind: str) -> tuple[float, str]:
        link = topology.link(span)
        gbps = hardware.intra_gbps if link == "intra" else hardware.inter_gbps
        latency = hardware.intra_latency_s if link == "intra" else hardware.inter_latency_s
        return _ring(volume, ranks, gbps, latency, kind), link

    comm: dict[str, float] = {}
    links: dict[str, str] = {}
    overhead = 0.0
    dense, experts = model.local_params(layout.tp, pp, layout.ep)
    local_params = dense + experts
    shards = layout.dp * layout.cp
    dp_span = layout.tp * layout.cp * layout.dp
    # expert gradients are reduced over the dp·cp/ep ranks that hold the same experts: as if there were fewer
    edp = shards // layout.ep
    reduced = dense + experts * ((edp - 1) / edp) / ((shards - 1) / shards) if shards > 1 and experts else local_params
    if shards > 1 and layout.zero_stage < 3:
        kind = "gather" if layout.zero_stage == 2 else "all_reduce"  # stage 2 reduces each bucket to its owner
        full, links["dp_grads"] = seconds(dp_span, grad_b * reduced, shards, kind)
        if pp == 1:  # DDP's and ZeRO-1/2's buckets overlap the backward that reduces them
            tail = full * min(1.0, DDP_BUCKET_BYTES / max(1.0, grad_b * local_params))
            comm["dp_grads"] = max(full - backward_last, tail) * (m if layout.zero_stage == 2 else 1)
        else:
            comm["dp_grads"] = full
        if layout.zero_stage:  # the updated chunks, all-gathered after the step
            comm["zero_gather"], links["zero_gather"] = seconds(dp_span, weight_b * local_params, shards, "gather")
    elif shards > 1:
        block = model.zero3_unit_params(layout.tp)  # fp32 weights grouped by sharding.unit_mb's default
        gather, links["zero3_gather"] = seconds(dp_span, weight_b * reduced, shards, "gather")
        first, _ = seconds(dp_span, weight_b * block, shards, "gather")
        reduce, links["zero3_reduce"] = seconds(dp_span, grad_b * reduced, shards, "gather")
        forward, backward = per_micro / 3, per_micro * 2 / 3
        comm["zero3_gather"] = m * (max(0.0, gather - forward) + max(0.0, gather - backward) + first)
        comm["zero3_reduce"] = max(0.0, reduce - backward) + reduce * block / max(1.0, local_params)
    if layout.tp > 1:
        links["tp"] = topology.link(layout.tp)
        per_layer = tp_layer_comm(
            hardware, topology, layout, seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, precision=precision
        )
        comm["tp"] = per_layer * layers / pp * m
        overhead = hardware.tp_overhead_s.get(layout.tp, 0.0) * layers / pp * m
    if pp > 1:
        boundary = seq_len / layout.cp * micro_batch * hidden * act_b
        link = topology.link(gpus // pp + 1)
        links["pp"] = link
        gbps = hardware.intra_gbps if link == "intra" else hardware.inter_gbps
        latency = hardware.intra_latency_s if link == "intra" else hardware.inter_latency_s
        comm["pp"] = 2 * m * v * (boundary / (gbps * 1e9) + latency)
    if layout.cp > 1:
        chunk = seq_len / layout.cp
        kv_hidden = hidden * (model.kv_heads or model.heads or 1) / (model.heads or 1)
        kv = 2 * chunk * micro_batch * kv_hidden * act_b / layout.tp  # the K and V chunk one ring step passes on
        link = links["cp"] = topology.link(layout.tp * layout.cp)
        gbps = hardware.intra_gbps if link == "intra" else hardware.inter_gbps
        latency = hardware.intra_latency_s if link == "intra" else hardware.inter_latency_s
        step_comm = kv / (gbps * 1e9) + latency
        step_attention = 4 * chunk * chunk * micro_batch * hidden / layout.tp / rate  # forward, one KV chunk
        hidden_behind = max(0.0, step_comm - step_attention) + max(0.0, 2 * step_comm - 2 * step_attention)
        comm["cp"] = (layout.cp - 1) * hidden_behind * layers / pp * m
    volume = all_to_all_bytes(model, layout, seq_len=seq_len, micro_batch=micro_batch, act_b=act_b)
    if volume:
        link = links["ep_all_to_all"] = topology.link(layout.tp * layout.ep)
        gbps = hardware.intra_gbps if link == "intra" else hardware.inter_gbps
        latency = hardware.intra_latency_s if link == "intra" else hardware.inter_latency_s
        calls = (6 if layout.activation_checkpointing == "full" else 4) + (2 if counting else 0)
        per_layer = volume / (gbps * 1e9) + calls * (layout.ep - 1) * latency
        comm["ep_all_to_all"] = per_layer * model.moe_layers / pp * m
    optimizer_params = (dense / shards + experts / edp) if layout.zero_stage >= 1 else local_params
    step_bytes = OPTIMIZER_BYTES_PER_PARAM[optimizer]
    optimizer_s = optimizer_params * step_bytes / (hardware.memory_tbps * 1e12)
    offload = 0.0
    if layout.offload != "none":
        transfer = optimizer_params * (grad_b + weight_b) / (hardware.host_gbps * 1e9)
        offload = transfer + optimizer_params * step_bytes / (HOST_MEMORY_GBPS * 1e9) - optimizer_s
    reference_s = (compute + bubble) / 3 if reference in ("copy", "adapters") else 0.0
    step = compute + recompute + bubble + sum(comm.values()) + overhead + optimizer_s + offload + reference_s
    return StepTime(
        compute_s=compute,
        recompute_s=recompute,
        bubble_s=bubble,
        optimizer_s=optimizer_s,
        offload_s=max(0.0, offload),
        overhead_s=overhead,
        reference_s=reference_s,
        comm_s=comm,
        comm_link=links,
        step_s=step,
        tokens_per_s=tokens / step,
        mfu=model_flops / (step * gpus * hardware.peak_tflops * 1e12),
    )
