"""`layout: auto`: the planner proposes the layouts that fit this model on this world; each is tried on the real
ranks for a few measured steps (step time and memory), and the fastest that stays under the memory limit is
the run's layout — all inside the processes already running (every probe is an Engine that joins the one
process group, builds a fresh model, and leaves).

The device the planner costs with is measured first (matmul rate, memory bandwidth, all-reduce bandwidth and
latency, `meshkit.planning.probe`). The global batch stays the one the config gives (micro-batch × accumulation ×
data-parallel ranks): each candidate splits it its own way (micro-batches no larger than the config's).
A candidate that fails on every rank (a layout the model cannot take) is dropped with its error; a failure on
some ranks only is a hang the hang doctor reports, as in training.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from meshkit.config.layout import Layout, check_pipeline
from meshkit.config.resolve import ResolvedConfig
from meshkit.config.schema import RunConfig
from meshkit.core.errors import MeshkitError, one_line
from meshkit.parallel.zero.sharding import effective_zero_stage
from meshkit.planning.estimate import ModelShape
from meshkit.planning.hardware import Hardware
from meshkit.planning.perf_model import predict
from meshkit.planning.plan import Cluster, plan, to_config
from meshkit.planning.probe import measure_profile
from meshkit.planning.step_recipe import LossKind, StepRecipe
from meshkit.planning.workload_probe import model_profile
from meshkit.runtime.mesh import ProcessInfo, select_device, start_process_group, stop_process_group

PROBED = "layout: auto (probed)"
# A function that prepares a run on an engine and returns one optimizer step as a callable.
StepBuilder = Callable[[Any], Callable[[], None]]


class LayoutProbeError(MeshkitError):
    """No candidate layout could run."""


@dataclass
class Candidate:
    layout: Layout  # as it will run (micro-batches of the probe's size)
    values: dict[str, Any]  # dotted config keys that ask for the layout
    predicted_step_s: float
    predicted: dict[str, Any] = field(default_factory=dict)  # the step-time model's breakdown
    step_s: float | None = None
    held_mb: float | None = None  # params + grads + optimizer state per rank (the largest rank)
    peak_mb: float | None = None  # device peak (CUDA) per rank, the largest
    error: str | None = None

    @property
    def description(self) -> str:
        return self.layout.summary()

    def row(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["layout"] = self.layout.as_json()
        return {"description": self.description, **fields}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def layout_values(layout: Layout, global_batch: int, micro_batch: int, seq_len: int) -> dict[str, Any]:
    """The config keys of `layout` for `global_batch` sequences per step, micro-batches of at most `micro_batch`."""
    per_rank = global_batch // layout.dp
    # the largest micro-batch that divides the rank's batch (and leaves a pipeline at least pp micro-batches)
    micro = max(d for d in range(1, min(micro_batch, per_rank) + 1) if per_rank % d == 0 and per_rank // d >= layout.pp)
    values = _flat(to_config(layout, Cluster(1, 1.0), seq_len, global_batch, "fp32"))
    for key in [k for k in values if k.startswith(("launch.", "train.", "pipeline.")) or k == "precision"]:
        del values[key]
    values.update({"activation_checkpointing.mode": layout.activation_checkpointing, "pipeline.stages_per_rank": None})
    values.update({"sharding.offload": layout.offload, "pipeline.schedule": "1f1b", "pipeline.microbatches": None})
    if layout.pp > 1:  # the pipeline cuts the rank's batch into its micro-batches
        values.update({"train.micro_batch_size": per_rank, "grad_accum_steps": 1})
        values["pipeline.microbatches"] = per_rank // micro
        if layout.stages_per_rank > 1:
            values.update({"pipeline.schedule": "interleaved_1f1b", "pipeline.stages_per_rank": layout.stages_per_rank})
    else:
        values.update({"train.micro_batch_size": micro, "grad_accum_steps": per_rank // micro})
    return values


def with_values(resolved: ResolvedConfig, values: dict[str, Any], label: str = PROBED) -> ResolvedConfig:
    """`resolved` with `values` (dotted keys) set, each labelled `label`, revalidated."""
    data = resolved.config.model_dump()
    for key, value in values.items():
        node = data
        *path, leaf = key.split(".")
        for part in path:
            node = node[part]
        node[leaf] = value
    sources = dict(resolved.sources)
    sources.update({key: label for key in values if key in sources})
    return ResolvedConfig(RunConfig(**data), sources, resolved.conflicts)


@dataclass(frozen=True)
class Workload:
    """What the planner costs: the model's shape and one optimizer step's batch, and how this machine's
    measured profile is refined with the model's own work (collective; None: matmul rate as measured)."""

    shape: ModelShape
    seq_len: int
    global_batch: int  # sequences per optimizer step, kept by every candidate
    micro_batch: int  # the largest micro-batch (per rank) a candidate may use
    refine: Callable[[Hardware], Hardware] | None = None
    loss: LossKind = "plain"  # fused: train_step computes the causal-LM loss a chunk at a time (`fused_loss`)

    @classmethod
    def of_config(cls, config: RunConfig, world: int, local_world: int, device: torch.device) -> Workload:
        """The reference GPT of `meshkit train` at the config's batch."""
        dims = Layout.from_config(config.parallel, world)
        global_batch = config.train.global_micro_batch(dims.dp_replicate * dims.dp_shard) * config.grad_accum_steps

        def refine(hardware: Hardware) -> Hardware:
            return model_profile(hardware, config, device, world, local_world)

        shape = ModelShape.from_gpt(config.model)
        return cls(shape, config.train.seq_len, global_batch, config.train.largest_micro_batch, refine)


def propose(
    resolved: ResolvedConfig, world: int, local_world: int, device: torch.device, workload: Workload | None = None
) -> list[Candidate]:
    """The planner's fastest `probe.top_k` layouts for this world, costed on this machine's measured profile
    (collective: the profile is measured on every rank)."""
    cfg = resolved.config
    work = workload or Workload.of_config(cfg, world, local_world, device)
    hidden = work.shape.hidden or 1024
    gemm = (work.micro_batch * work.seq_len, hidden, hidden)  # the model's own GEMM: tokens × hidden × hidden
    hardware = measure_profile(None, device, quick=True, matmul_shape=gemm)
    if work.refine is not None:
        hardware = work.refine(hardware)
    return candidates_on(resolved, world, local_world, work, hardware)


def candidates_on(
    resolved: ResolvedConfig, world: int, local_world: int, work: Workload, hardware: Hardware
) -> list[Candidate]:
    """The planner's fastest `probe.top_k` layouts for `world` ranks on `hardware`, each with the config keys
    that ask for it; a layout the run would refuse carries the reason as its error (it is not probed)."""
    cfg = resolved.config
    limit = cfg.probe.memory_limit_gb or hardware.memory_gb * 0.9
    cluster = Cluster(local_world, limit / 0.9, max(1, world // local_world), device=hardware)
    precision = "fp32" if cfg.precision == "no" else cfg.precision
    shape, global_batch = work.shape, work.global_batch
    recipe = StepRecipe(compiled=cfg.compile.enabled, loss=work.loss)
    result = plan(shape, cluster, seq_len=work.seq_len, global_batch=global_batch, precision=precision, recipe=recipe)
    chosen = diverse([p.layout for p in result.fitting if p.layout.offload == "none"], cfg.probe.top_k)
    if not chosen:
        raise LayoutProbeError(f"layout: auto: {result.suggestion or 'the planner found no layout for this world'}")
    out = []
    for layout in chosen:
        values = layout_values(layout, global_batch, work.micro_batch, work.seq_len)
        refused = refusal(resolved, values, world)
        pipelined = layout.pp > 1
        micro_batch = values["train.micro_batch_size"] // (values["pipeline.microbatches"] if pipelined else 1)
        steps = values["pipeline.microbatches"] if pipelined else values["grad_accum_steps"]
        real = replace(layout, microbatches=steps)  # as it will run: micro-batches of `micro_batch` sequences
        time = predict(
            shape, real, cluster.topology(), hardware, seq_len=work.seq_len,
            global_batch=global_batch, micro_batch=micro_batch, precision=precision,
        )  # fmt: skip
        out.append(Candidate(real, values, time.step_s, time.as_json(), error=refused))
    return out


def refusal(resolved: ResolvedConfig, values: dict[str, Any], world: int) -> str | None:
    """Why the run would refuse the layout `values` ask for (the same checks it applies), or None."""
    try:
        config = with_values(resolved, {**values, "layout": "manual"}).config
        layout = Layout.from_config(config.parallel, world)
        if layout.pp > 1:
            check_pipeline(config.pipeline, layout.pp, config.train.largest_micro_batch, config.grad_accum_steps)
        effective_zero_stage(config.sharding, layout)
    except (MeshkitError, ValueError) as err:
        return f"{type(err).__name__}: {one_line(str(err))}"
    return None


def diverse(ranked: list[Layout], k: int) -> list[Layout]:
    """The best layout of each distinct parallel shape (dp, tp, pp, cp) in rank order, then the next-best
    variants (ZeRO stage, recomputation, chunks) until `k`: a probe learns most from different shapes."""
    seen: set[tuple[int, ...]] = set()
    first: list[Layout] = []
    rest: list[Layout] = []
    for layout in ranked:
        shape = (layout.dp, layout.tp, layout.pp, layout.cp)
        (rest if shape in seen else first).append(layout)
        seen.add(shape)
    return (first + rest)[:k]


def measure(resolved: ResolvedConfig, candidate: Candidate, build: StepBuilder, engine_class: Any) -> None:
    """Run `candidate` for one warm-up and `probe.steps` measured steps; fills its time and memory, or error."""
    config = with_values(resolved, {**candidate.values, "layout": "manual"})
    failed = ""
    try:
        with engine_class(config) as engine:
            step = build(engine)
            if engine.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(engine.device)
            step()
            times = []
            for _ in range(config.config.probe.steps):
                engine.wait_for_everyone()
                start = time.perf_counter()
                step()
                if engine.device.type == "cuda":
                    torch.cuda.synchronize(engine.device)
                times.append(time.perf_counter() - start)
            report = engine.memory_report()
            held = (report["params"] + report["grads"] + report["optimizer"]) / 2**20
            peak = torch.cuda.max_memory_allocated(engine.device) / 2**20 if engine.device.type == "cuda" else None
            numbers = torch.tensor([statistics.median(times), held, peak or 0.0], device=engine.device)
            dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
            candidate.step_s, candidate.held_mb = float(numbers[0]), float(numbers[1])
            candidate.peak_mb = float(numbers[2]) if peak is not None else None
    except (MeshkitError, RuntimeError, ValueError, NotImplementedError) as err:
        failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
    candidate.error = failed or None
    gc.collect()


@contextlib.contextmanager
def one_process_group(config: RunConfig) -> Iterator[ProcessInfo]:
    """The process group every probe's Engine and then the run's Engine join: started here unless one is
    running already (then left to its owner), destroyed at the end."""
    info = ProcessInfo.from_env()
    owned = start_process_group(info, select_device(config.device, info.local_rank), config.collective_timeout_s)
    try:
        yield info
    except BaseException:
        if owned:
            stop_process_group(wait_for_peers=False)
        raise
    if owned:
        stop_process_group(wait_for_peers=True)


def choose(
    resolved: ResolvedConfig, build: StepBuilder, engine_class: Any, workload: Workload | None = None
) -> tuple[ResolvedConfig, list[Candidate]]:
    """Probe the candidates and return the config of the fastest one under the memory limit, with the table."""
    if resolved.config.strategy != "auto":
        raise LayoutProbeError(
            f"layout: auto chooses among the parallel layouts, not for strategy: {resolved.config.strategy}: "
            "set strategy: auto or layout: manual"
        )
    info = ProcessInfo.from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    candidates = propose(resolved, info.world_size, info.local_world_size, device, workload)
    limit_gb = resolved.config.probe.memory_limit_gb
    if limit_gb is None and device.type == "cuda":  # a device of its own: 90 % of it (CPU: the planner's estimate)
        limit_gb = torch.cuda.get_device_properties(device).total_memory / 1e9 * 0.9
    limit_mb = (limit_gb or 0) * 1e9 / 2**20
    for candidate in candidates:
        if candidate.error is not None:  # refused by the run's own checks: named in the table, not run
            continue
        measure(resolved, candidate, build, engine_class)
        if candidate.error is None and limit_mb and (candidate.peak_mb or candidate.held_mb or 0) > limit_mb:
            candidate.error = (
                f"over the memory limit ({candidate.peak_mb or candidate.held_mb:.0f} MB > {limit_mb:.0f} MB)"
            )
    ran = [c for c in candidates if c.error is None and c.step_s is not None]
    if not ran:
        reasons = "; ".join(f"{c.description}: {c.error}" for c in candidates)
        raise LayoutProbeError(f"layout: auto: no candidate layout ran ({reasons})")
    best = min(ran, key=lambda c: c.step_s or float("inf"))
    return with_values(resolved, {**best.values, "layout": "manual"}), candidates


def print_probe_table(probed: list[Candidate]) -> None:
    """`layout: auto`: every candidate with its predicted and measured step, memory and fate."""
    table = Table(title="layout: auto — candidates probed on these ranks")
    for column in ("layout", "predicted step", "measured step", "held MB/rank", "result"):
        table.add_column(column)
    fastest = min((c.step_s for c in probed if c.error is None and c.step_s), default=None)
    for candidate in probed:
        result = candidate.error or ("chosen" if candidate.step_s == fastest else "")
        table.add_row(
            candidate.description,
            f"{candidate.predicted_step_s * 1e3:.1f} ms",
            f"{candidate.step_s * 1e3:.1f} ms" if candidate.step_s else "-",
            f"{candidate.held_mb:.1f}" if candidate.held_mb is not None else "-",
            result,
        )
    Console().print(table)
