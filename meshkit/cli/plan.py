"""`meshkit plan`: the strategy planner on the command line; `--emit-config` writes the top layout as YAML."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from meshkit.cli.estimate import HeadsOpt, HiddenOpt, LayersOpt, ModelArg, ParamsOpt, VocabOpt, model_shape
from meshkit.planning.estimate_ps import advice
from meshkit.planning.hardware import PRESETS, load_profile, preset
from meshkit.planning.plan import INTER_LINKS, INTRA_LINKS, Cluster, PlanError, PlannedLayout, plan, to_config


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
    seq_len: Annotated[int, typer.Option("--seq-len")] = 2048,
    global_batch: Annotated[int, typer.Option("--global-batch", help="sequences per optimizer step")] = 64,
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16 or fp16")] = "bf16",
    optimizer: Annotated[
        str, typer.Option("--optimizer", help="adam, adam8bit (bitsandbytes' 8-bit states) or sgd")
    ] = "adam",
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
) -> None:
    """The layouts that fit, fastest first: predicted step time, tokens/s, MFU, memory, communication, bubble."""
    if probe:
        raise typer.Exit(_probe(model, gpus_per_node))
    shape = model_shape(model, params, layers, hidden, heads, vocab)
    if gpu is not None and profile is not None:
        raise PlanError("--gpu and --profile both name the device: give one")
    device = load_profile(profile) if profile is not None else preset(gpu or "a100")
    memory = gpu_mem_gb if gpu_mem_gb is not None else device.memory_gb
    cluster = Cluster(gpus_per_node, memory, nodes, intra_node, inter_node, device)
    if optimizer not in ("adam", "adam8bit", "sgd"):
        raise PlanError(f"--optimizer {optimizer!r} is not one the planner knows: adam, adam8bit or sgd")
    result = plan(shape, cluster, seq_len=seq_len, global_batch=global_batch, precision=precision, optimizer=optimizer)
    if not result.fitting:
        raise PlanError(result.suggestion)
    shown = result.fitting[:top]
    if as_json:
        print(json.dumps([layout.as_json() for layout in shown], indent=2))
    else:
        title = f"layouts that fit {gpus_per_node}×{nodes} {device.name} of {memory:g} GB, fastest first"
        table = Table(title=title)
        for column in ("#", "layout", "step s", "tokens/s", "MFU", "memory GB", "comm GB/step", "bubble", "why"):
            table.add_column(column)
        for rank, layout in enumerate(shown, 1):
            time = layout.time
            table.add_row(
                str(rank),
                layout.describe(),
                f"{layout.step_s:.3g}",
                f"{time.tokens_per_s:,.0f}" if time else "",
                f"{time.mfu:.0%}" if time else "",
                f"{layout.memory_gb:.1f}",
                f"{layout.comm_gb:.2f}",
                f"{layout.bubble:.2f}",
                layout.reason,
            )
        Console().print(table)
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
