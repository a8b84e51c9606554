"""`meshkit plan`: the strategy planner on the command line; `--emit-config` writes the top layout as YAML."""

from __future__ import annotations

import functools
import json
import textwrap
from pathlib import Path
from typing import Annotated, Any, Optional, cast, get_args

import typer
import yaml
from rich.console import Console
from rich.table import Table

from meshkit.cli.config_run import run_values
from meshkit.cli.estimate import HeadsOpt, HiddenOpt, LayersOpt, ModelArg, ParamsOpt, VocabOpt, model_shape
from meshkit.cli.recipe_options import (
    AttentionOpt,
    CompileOpt,
    LossOpt,
    OptimizerStepOpt,
    TiledMlpOpt,
    WeightsOpt,
    step_recipe,
)
from meshkit.cli.tp_plan_view import print_tensor_parallel
from meshkit.planning.estimate import Optimizer, Precision, Reference
from meshkit.planning.estimate_ps import advice
from meshkit.planning.hardware import PRESETS, load_profile, preset
from meshkit.planning.plan import (
    HEADROOM,
    INTER_LINKS,
    INTRA_LINKS,
    TIE,
    Cluster,
    LayoutFilter,
    Plan,
    PlanError,
    PlannedLayout,
    plan,
    to_config,
)

# CUDA context, NCCL's buffers and the allocator's workspaces on a GPU: an allowance (1-3 GB is usual), stated
RUNTIME_ALLOWANCE_GB = 2.0
# what `meshkit plan` assumes of a run where neither a flag nor a config says
PLAN_DEFAULTS: dict[str, Any] = {
    "seq_len": 2048, "global_batch": 64, "precision": "bf16", "optimizer": "adam", "reference": "none",
    "compiled": False, "attention": "sdpa", "loss": "plain", "tiled_mlp": False,
}  # fmt: skip


def plan_command(
    model: ModelArg = None,
    params: ParamsOpt = None,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    vocab: VocabOpt = None,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node")] = 8,
    gpu_mem_gb: Annotated[Optional[float], typer.Option("--gpu-mem-gb", help="default: the device's memory")] = None,
    nodes: Annotated[int, typer.Option("--nodes")] = 1,
    gpu: Annotated[
        Optional[str], typer.Option("--gpu", help=f"device preset: {', '.join(PRESETS)} (default a100)")
    ] = None,
    profile: Annotated[
        Optional[Path], typer.Option("--profile", help="a measured profile (meshkit bench comm --profile FILE)")
    ] = None,
    intra_node: Annotated[
        Optional[str], typer.Option("--intra-node", help=f"{', '.join(INTRA_LINKS)} (default: the device's)")
    ] = None,
    inter_node: Annotated[
        Optional[str], typer.Option("--inter-node", help=f"{', '.join(INTER_LINKS)} (default: the device's)")
    ] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="default: the config's, else 2048")] = None,
    global_batch: Annotated[
        Optional[int],
        typer.Option("--global-batch", help="sequences per optimizer step (default: the config's, else 64)"),
    ] = None,
    precision: Annotated[Optional[str], typer.Option("--precision", help="fp32, bf16 or fp16")] = None,
    optimizer: Annotated[
        Optional[str],
        typer.Option("--optimizer", help="adam, adam8bit (8-bit states), adam4bit (torchao's 4-bit states) or sgd"),
    ] = None,
    top: Annotated[int, typer.Option("--top", help="layouts shown")] = 8,
    stragglers: Annotated[
        bool,
        typer.Option("--stragglers", help="some ranks are slower (mixed or shared hardware): weigh a parameter server"),
    ] = False,
    emit_config: Annotated[Optional[Path], typer.Option("--emit-config", help="write the top layout as YAML")] = None,
    probe: Annotated[
        bool,
        typer.Option(
            "--probe", help="with a meshkit YAML: run the top layouts on --gpus-per-node local ranks and time them"
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    strategy: Annotated[
        Optional[str],
        typer.Option("--strategy", help="only this data-parallel kind: ddp, zero1, zero2, zero3 (= fsdp)"),
    ] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", help="only this tensor-parallel size")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", help="only this pipeline size")] = None,
    cp: Annotated[Optional[int], typer.Option("--cp", help="only this context-parallel size")] = None,
    recompute: Annotated[
        Optional[str], typer.Option("--recompute", help="only this activation checkpointing: none, selective, full")
    ] = None,
    offload: Annotated[Optional[str], typer.Option("--offload", help="only this offload: none or cpu")] = None,
    runtime_gb: Annotated[
        float,
        typer.Option("--runtime-gb", help="counted on every GPU for the CUDA context and communication buffers"),
    ] = RUNTIME_ALLOWANCE_GB,
    host_mem_gb: Annotated[
        Optional[float], typer.Option("--host-mem-gb", help="host memory per node offloaded states may use")
    ] = None,
    explain: Annotated[
        bool, typer.Option("--explain", help="each memory term of the first layout (or of the smallest, if none fits)")
    ] = False,
    reference: Annotated[
        Optional[str],
        typer.Option("--reference", help="preference training's reference: copy, adapters, precomputed or none"),
    ] = None,
    compiled: CompileOpt = None,
    attention: AttentionOpt = None,
    loss: LossOpt = None,
    tiled_mlp: TiledMlpOpt = None,
    optimizer_step: OptimizerStepOpt = "foreach",
    weights: WeightsOpt = "autocast",
) -> None:
    """The layouts that fit, fastest first: predicted step time, tokens/s, MFU, memory, communication, bubble."""
    if probe:
        raise typer.Exit(_probe(model, gpus_per_node))
    given = {"seq_len": seq_len, "global_batch": global_batch, "precision": precision, "optimizer": optimizer,
             "reference": reference, "compiled": compiled, "attention": attention, "loss": loss,
             "tiled_mlp": tiled_mlp}  # fmt: skip
    # the run a config starts: its sequence, batch, precision and recipe (flags override)
    run, v, _ = run_values(model, given, PLAN_DEFAULTS)
    shape = run.shape if run is not None else model_shape(model, params, layers, hidden, heads, vocab)
    seq_len, global_batch, precision, optimizer = v["seq_len"], v["global_batch"], v["precision"], v["optimizer"]
    reference, compiled, attention, loss = v["reference"], v["compiled"], v["attention"], v["loss"]
    if gpu is not None and profile is not None:
        raise PlanError("--gpu and --profile both name the device: give one")
    device = load_profile(profile) if profile is not None else preset(gpu or "a100")
    memory = gpu_mem_gb if gpu_mem_gb is not None else device.memory_gb
    cluster = Cluster(gpus_per_node, memory, nodes, intra_node, inter_node, device)
    if optimizer not in get_args(Optimizer):
        raise PlanError(f"--optimizer {optimizer!r} is not one the planner knows: adam, adam8bit, adam4bit or sgd")
    if precision not in get_args(Precision):
        raise PlanError(f"--precision {precision!r} is not one the planner knows: fp32, bf16 or fp16")
    if reference not in get_args(Reference):
        raise PlanError(f"--reference {reference!r}: choose copy, adapters, precomputed or none")
    recipe = step_recipe(compiled, attention, loss, optimizer_step, weights, v["tiled_mlp"])
    only = LayoutFilter.of(strategy, tp=tp, pp=pp, cp=cp, activation_checkpointing=recompute, offload=offload)
    result = plan(
        shape, cluster, seq_len=seq_len, global_batch=global_batch, precision=cast(Precision, precision),
        optimizer=cast(Optimizer, optimizer), only=only, runtime_gb=runtime_gb, host_mem_gb=host_mem_gb,
        reference=cast(Reference, reference), recipe=recipe,
    )  # fmt: skip
    if explain:
        chosen = result.fitting[0] if result.fitting else result.smallest
        explain_layout(chosen, result, memory, runtime_gb)
        if model is not None and model.suffix == ".json":
            print_tensor_parallel(model)
        if not result.fitting:
            raise PlanError(result.suggestion)
        return
    if not result.fitting:
        raise PlanError(result.suggestion)
    shown = result.fitting[:top]
    if as_json:
        print(json.dumps([layout.as_json() for layout in shown], indent=2))
    else:
        title = f"layouts that fit {gpus_per_node}×{nodes} {device.name} of {memory:g} GB, fastest first"
        if any(layout.tied for layout in shown):
            title += f"; ≈: within {TIE:.0%} of the fastest, the simpler layout first"
        Console().print(layout_table(shown, title))
        for rank, layout in enumerate(shown, 1):
            Console().print(f"{rank}. {layout.reason}", highlight=False)
        Console().print(
            f"memory: per GPU within {result.budget_gb:.1f} GB ({memory:g} GB × {HEADROOM:.0%}), {runtime_gb:g} GB "
            f"of it for the runtime (--runtime-gb); {len(result.dropped)} layout(s) over a limit (--explain)",
            highlight=False,
        )
        Console().print(advice(shape, cluster, stragglers))
    if emit_config is not None:
        _emit(result.fitting, cluster, seq_len, global_batch, precision, model, emit_config)


def _probe(model: Path | None, ranks: int) -> int:
    """`--probe`: the layouts `layout: auto` would try, timed on this node (the model is the reference GPT of a
    meshkit YAML; its train section gives the batch)."""
    if model is None or model.suffix not in (".yaml", ".yml"):
        raise PlanError("--probe runs the model: give a meshkit YAML (model and train sections) as MODEL")
    from meshkit.config.schema import LaunchSettings
    from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch

    target = LaunchTarget("meshkit.recipes.probe_layouts", (str(model),), module=True)
    return launch(target, LaunchPlan(LaunchSettings(nproc_per_node=ranks)))


def _emit(
    fitting: list[PlannedLayout],
    cluster: Cluster,
    seq_len: int,
    batch: int,
    precision: str,
    model: Path | None,
    path: Path,
) -> None:
    chosen = fitting[0]
    config = to_config(chosen.layout, cluster, seq_len, batch, precision)
    if model is not None and model.suffix in (".yaml", ".yml"):
        from meshkit.config.resolve import resolve

        config["model"] = resolve(file=model).config.model.model_dump(exclude_defaults=True)
    path.write_text(
        f"# meshkit plan: {chosen.describe()} - {chosen.reason}\n" + yaml.safe_dump(config, sort_keys=False)
    )
    Console().print(f"wrote {path}: {chosen.describe()}")


def short_layout(planned: PlannedLayout) -> str:
    """'dp4 tp2 pp2 ZeRO-3 m8 v2 AC-sel off': sizes of 1 left out, for a table that fits 80 columns."""
    layout = planned.layout
    parts = [f"{name}{size}" for name, size in (("dp", layout.dp), ("tp", layout.tp), ("pp", layout.pp),
                                                ("cp", layout.cp), ("ep", layout.ep)) if size > 1]  # fmt: skip
    parts.append(f"ZeRO-{layout.zero_stage}")
    if layout.pp > 1 or layout.microbatches > 1:
        parts.append(f"{'m' if layout.pp > 1 else 'acc'}{layout.microbatches}")
    if layout.stages_per_rank > 1:
        parts.append(f"v{layout.stages_per_rank}")
    if layout.activation_checkpointing != "none":
        parts.append({"selective": "AC-sel", "full": "AC-full"}[layout.activation_checkpointing])
    if layout.offload != "none":
        parts.append(f"off-{layout.offload}")
    return " ".join(parts)


def layout_table(shown: list[PlannedLayout], title: str) -> Table:
    """One row per layout in under 80 columns; the reasons follow the table as numbered lines."""
    host = any(layout.host_gb_per_node for layout in shown)
    table = Table(title=title, title_justify="left")
    for column in ("#", "layout", "step s", "tokens/s", "MFU", "GPU GB", *(["host/node"] if host else []), "comm GB"):
        table.add_column(column, no_wrap=column != "layout")
    for rank, layout in enumerate(shown, 1):
        time = layout.time
        table.add_row(
            str(rank),
            short_layout(layout),
            f"{'≈' if layout.tied else ''}{layout.step_s:.3g}",
            f"{time.tokens_per_s:,.0f}" if time else "",
            f"{time.mfu:.0%}" if time else "",
            f"{layout.memory_gb:.1f}",
            *([f"{layout.host_gb_per_node:.0f}"] if host else []),
            f"{layout.comm_gb:.1f}",
        )
    return table


def explain_layout(chosen: PlannedLayout | None, result: Plan, memory_gb: float, runtime_gb: float) -> None:
    """Each memory term of `chosen`, the per-GPU limit and where it stands; the layouts dropped nearest the limit."""
    console = Console()
    if chosen is None or chosen.estimate is None:
        console.print("no layout could be costed")
        return
    say = functools.partial(_hanging, console)
    say(f"{short_layout(chosen)}  ", f"({chosen.describe()})")
    for line in chosen.estimate.lines:
        say(f"  {line.name:<14}{line.gb:>8.2f} GB  ", line.formula)
    say(f"  {'total':<14}{chosen.memory_gb:>8.2f} GB  ", chosen.estimate.total_formula)
    if chosen.host_gb_per_node:
        say(f"  {'host memory':<14}{chosen.host_gb_per_node:>8.1f} GB  ", "per node (offloaded optimizer states)")
    verdict = "fits" if chosen.memory_gb <= result.budget_gb else "does not fit"
    say(
        f"  {'limit':<14}{result.budget_gb:>8.2f} GB  ",
        f"= {memory_gb:g} GB × {HEADROOM:.0%} headroom (runtime {runtime_gb:g} GB counted above): {verdict}",
    )
    for near in result.dropped[:3]:
        from meshkit.planning.plan import over_limit

        say(f"  dropped: {short_layout(near)}: ", str(over_limit(near, result.budget_gb, None)))


def _hanging(console: Console, head: str, text: str) -> None:
    """`head` then `text`, wrapped at the console's width with the continuation lines under the text's start (a
    narrow terminal no longer wraps the formulas to column 0)."""
    width = max(console.width, len(head) + 20)
    lines = textwrap.wrap(text, width - len(head)) or [""]
    console.print(head + lines[0], highlight=False, soft_wrap=True)
    for line in lines[1:]:
        console.print(" " * len(head) + line, highlight=False, soft_wrap=True)
