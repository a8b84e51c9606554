"""The `meshkit` command: launch, train, config, env."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.prompt import Prompt
from rich.table import Table

from meshkit.cli.config_sources import collect_flags, shown_config
from meshkit.cli.estimate import estimate_command
from meshkit.cli.plan import plan_command
from meshkit.config.idle import idle_values
from meshkit.config.resolve import ResolvedConfig, default_config_path, resolve
from meshkit.config.schema import LaunchSettings
from meshkit.core.errors import MeshkitError, one_line
from meshkit.launching.cluster import cluster_settings
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.launching.preflight import (
    check_job,
    check_layout,
    check_model,
    check_outputs,
    check_recipe,
    check_resume_path,
    splits_the_model,
)
from meshkit.launching.stderr_filter import quiet_third_party_loggers
from meshkit.planning.commbench import OPS, parse_ops, parse_sizes
from meshkit.runtime.mesh import ProcessInfo

app = typer.Typer(
    name="meshkit",
    help="Train PyTorch models on many processes, devices and machines with any parallelism.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Write the config file (questionnaire), or show the resolved config.")
app.add_typer(config_app, name="config")

USER_ERRORS = (MeshkitError, FileNotFoundError)  # one line on stderr, exit code 2
PASS_THROUGH = {"allow_interspersed_args": False, "ignore_unknown_options": True}


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input ends the command with one line naming the problem, not a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as err:
            Console(stderr=True).print(
                f"[bold red]meshkit: error:[/] {escape(one_line(str(err)))}", highlight=False, soft_wrap=True
            )
            raise typer.Exit(2) from None

    return run


def parse_nnodes(value: str | None) -> tuple[int | None, int | None]:
    """'4' -> (None, 4); '1:4' -> (1, 4) (elastic)."""
    if value is None:
        return None, None
    low, _, high = value.partition(":")
    try:
        return (int(low), int(high)) if high else (None, int(low))
    except ValueError:
        raise MeshkitError(f"--nnodes {value}: give a node count (2) or MIN:MAX for an elastic job (1:4)") from None


def print_resolved(resolved: ResolvedConfig) -> None:
    table = Table(title="meshkit config (highest precedence: code > flags > env > file > default)")
    for column in ("key", "value", "source"):
        table.add_column(column, overflow="fold")  # (a key is never cut short: it is what you type)
    for key, value, source in resolved.rows():
        table.add_row(key, value, source, style=None if source == "default" else "bold")
    # piped or redirected: as wide as the rows need, so every key and value is whole on its line
    Console(width=None if sys.stdout.isatty() else 400).print(table)
    for conflict in resolved.conflicts:
        Console(stderr=True).print(f"[yellow]warning:[/] {conflict.message()}")


def tell_idle_settings(resolved: ResolvedConfig) -> None:
    """One notice per value a person chose that changes nothing here (a scheduler's values pass)."""
    for note in idle_values(resolved.config, dict(resolved.sources)):
        print(f"meshkit launch: {note}", file=sys.stderr, flush=True)


NprocOpt = Annotated[Optional[int], typer.Option("--nproc-per-node", help="worker processes on this node")]
NnodesOpt = Annotated[
    Optional[str], typer.Option("--nnodes", help="number of nodes, or MIN:MAX for an elastic job (e.g. 1:4)")
]
NodeRankOpt = Annotated[Optional[int], typer.Option("--node-rank", help="rank of this node (0 hosts)")]
AddrOpt = Annotated[Optional[str], typer.Option("--master-addr", help="address of node 0")]
PortOpt = Annotated[Optional[int], typer.Option("--master-port", help="rendezvous port on node 0")]
LocalAddrOpt = Annotated[
    Optional[str],
    typer.Option("--local-addr", help="this node's address for its stores (default: the route to node 0)"),
]
RestartsOpt = Annotated[Optional[int], typer.Option("--max-restarts", help="restarts after a failure")]
BackendOpt = Annotated[
    Optional[str], typer.Option("--backend", help="elastic (torch's agent on each node) or ray (a Ray cluster)")
]
RayAddressOpt = Annotated[
    Optional[str], typer.Option("--ray-address", help="backend ray: auto, ray://host:10001; default a local cluster")
]
RdzvOpt = Annotated[Optional[float], typer.Option("--rdzv-timeout", help="seconds to wait for all nodes")]
ConfigFileOpt = Annotated[Optional[Path], typer.Option("--config-file", help="YAML config file")]
PrecisionOpt = Annotated[Optional[str], typer.Option("--precision", help="no, bf16 or fp16")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="any config key: --set tp=2 (repeatable)")]


@app.command("launch", context_settings=PASS_THROUGH)
@user_errors
def launch_command(
    script: Annotated[str, typer.Argument(help="training script (or module with -m)")],
    args: Annotated[Optional[list[str]], typer.Argument(help="arguments for the script")] = None,
    module: Annotated[bool, typer.Option("-m", "--module", help="run SCRIPT as a module")] = False,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    master_addr: AddrOpt = None,
    master_port: PortOpt = None,
    local_addr: LocalAddrOpt = None,
    max_restarts: RestartsOpt = None,
    rdzv_timeout: RdzvOpt = None,
    backend: BackendOpt = None,
    ray_address: RayAddressOpt = None,
    config_file: ConfigFileOpt = None,
    precision: PrecisionOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run SCRIPT on every rank: `meshkit launch --nproc-per-node 4 train.py --lr 3e-4`."""
    min_nodes, max_nodes = parse_nnodes(nnodes)
    flags, labels = collect_flags(
        {
            "launch.nproc_per_node": ("--nproc-per-node", nproc_per_node),
            "launch.nnodes": ("--nnodes", max_nodes),
            "launch.min_nnodes": ("--nnodes", min_nodes),
            "launch.node_rank": ("--node-rank", node_rank),
            "launch.master_addr": ("--master-addr", master_addr),
            "launch.master_port": ("--master-port", master_port),
            "launch.local_addr": ("--local-addr", local_addr),
            "launch.max_restarts": ("--max-restarts", max_restarts),
            "launch.rdzv_timeout_s": ("--rdzv-timeout", rdzv_timeout),
            "launch.backend": ("--backend", backend),
            "launch.ray_address": ("--ray-address", ray_address),
            "precision": ("--precision", precision),
        },
        set_ or [],
    )
    cluster = cluster_settings(os.environ)
    resolved = resolve(flags=flags, flag_labels=labels, file=config_file, cluster=cluster)
    check_job(resolved.config, dict(resolved.sources))
    tell_idle_settings(resolved)
    plan = LaunchPlan.from_config(
        resolved.config, config_file=str(config_file) if config_file else None, flags=flags, flag_labels=labels
    )
    raise typer.Exit(launch(LaunchTarget(script, tuple(args or ()), module), plan))


@app.command(context_settings=PASS_THROUGH)
@user_errors
def train(
    config: Annotated[Path, typer.Argument(help="YAML config of the run")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="key=value overrides, e.g. tp=2 steps=50")] = None,
) -> None:
    """Train the reference GPT with the built-in recipe: `meshkit train examples/demo.yaml train.steps=50`."""
    # Imported here: the engine's imports take seconds that `estimate`, `plan` or `config` need not pay.
    from meshkit.recipes.train import resolve_recipe
    from meshkit.recipes.train import train as run_recipe

    assignments = overrides or []
    launched = ProcessInfo.from_env().launched  # a worker: RANK and WORLD_SIZE are torch's ranks, not nodes
    resolved = resolve_recipe(config, assignments, cluster=not launched)
    settings = resolved.config.launch
    if launched or (settings.backend == "elastic" and settings.world_size == 1):
        run_recipe(resolved)
        return
    check_recipe(resolved.config)
    tell_idle_settings(resolved)
    target = LaunchTarget("meshkit.recipes.train", (str(config), *assignments), module=True)
    raise typer.Exit(launch(target, LaunchPlan.from_config(resolved.config)))


@app.command(context_settings=PASS_THROUGH)
@user_errors
def finetune(
    config: Annotated[Path, typer.Argument(help="YAML config (Axolotl keys + meshkit keys)")],
    overrides: Annotated[
        Optional[list[str]], typer.Argument(help="key=value overrides, e.g. learning_rate=1e-4 zero_stage=3")
    ] = None,
) -> None:
    """Fine-tune a transformers causal LM on JSONL, full or LoRA: `meshkit finetune examples/finetune/lora.yaml`."""
    quiet_third_party_loggers()  # before transformers imports them (launched workers: the launcher's filter)
    from meshkit.recipes.finetune import check_layout as check_recipe_layout
    from meshkit.recipes.finetune import finetune as run_recipe
    from meshkit.recipes.finetune_config import check_finetune_inputs, resolve_finetune
    from meshkit.recipes.hf_base import tokenizer_directory

    assignments = overrides or []
    launched = ProcessInfo.from_env().launched
    job = resolve_finetune(config, assignments, cluster=not launched)
    settings = job.resolved.config.launch
    if launched or (settings.backend == "elastic" and settings.world_size == 1):
        run_recipe(job)
        return
    for dims in check_layout(job.resolved.config):  # what the recipe cannot do in each layout the job may have
        check_recipe_layout(job.resolved.config, dims, job)
    tokenizer_directory(job.settings)
    check_finetune_inputs(job.settings)
    check_outputs(job.resolved.config)
    if splits_the_model(job.resolved.config):  # the base model's heads, blocks and experts, before any worker
        from meshkit.recipes.hf_base import build_meta_model

        check_model(build_meta_model(job.settings), job.resolved.config)
    check_resume_path(job.resolved.config)
    tell_idle_settings(job.resolved)
    target = LaunchTarget("meshkit.recipes.finetune", (str(config), *assignments), module=True)
    raise typer.Exit(launch(target, LaunchPlan.from_config(job.resolved.config)))


@config_app.callback(invoke_without_command=True)
@user_errors
def config_questionnaire(
    ctx: typer.Context,
    config_file: Annotated[Optional[Path], typer.Option("--config-file", help="where to write")] = None,
) -> None:
    """Answer a few questions; the answers are written as the default config file."""
    if ctx.invoked_subcommand is not None:
        return
    from meshkit.config.questionnaire import ask_config, write_config

    def ask(question: str, default: Any, choices: list[str] | None) -> str:
        return Prompt.ask(question, default=str(default), choices=choices)

    path = config_file or default_config_path(os.environ)
    written = write_config(ask_config(ask), path)
    Console().print(f"config written to [bold]{written}[/]; check it with `meshkit config show`")


@config_app.command("show")
@user_errors
def config_show(
    config: Annotated[
        Optional[str], typer.Argument(help="the run's YAML (a meshkit or fine-tune config), as `train` takes it")
    ] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(help="key=value overrides, e.g. tp=2")] = None,
    config_file: ConfigFileOpt = None,
    set_: SetOpt = None,
) -> None:
    """Print every resolved key with its value and where the value came from (as a launch here would see it)."""
    print_resolved(shown_config(config, [*(overrides or []), *(set_ or [])], config_file))


@config_app.command("import")
@user_errors
def config_import(
    source: Annotated[Path, typer.Argument(help="an Accelerate config YAML or a DeepSpeed config JSON")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="write here (else print the YAML)")] = None,
    world: Annotated[
        Optional[int], typer.Option("--world", help="ranks, to split DeepSpeed's train_batch_size per rank")
    ] = None,
) -> None:
    """An Accelerate or DeepSpeed config as meshkit YAML, a comment per key naming its origin."""
    from meshkit.config.importing import import_config, to_yaml

    imported = import_config(source, world=world)
    text = to_yaml(imported, source)
    resolve(file_values=imported.values, file=source, env={})  # the result must be a valid meshkit config
    for origin, why in imported.skipped:
        print(f"meshkit: not imported: {origin}: {why}", file=sys.stderr)
    if output is None:
        print(text, end="")
        return
    partial = output.with_name(f".{output.name}.partial")
    partial.write_text(text)
    os.replace(partial, output)
    Console().print(f"wrote {output} ({len(imported.values)} settings, {len(imported.skipped)} not imported)")


@app.command("export")
@user_errors
def export_command(
    checkpoint: Annotated[Path, typer.Argument(help="a save_state checkpoint, or a checkpoint root (its newest)")],
    out_dir: Annotated[Path, typer.Argument(help="where the safetensors shards and index go")],
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="largest shard, e.g. 500MB, 2GB")] = "2GB",
) -> None:
    """Convert a checkpoint (any layout, any world size) to safetensors shards + index.json, in one process."""
    from meshkit.checkpoint.model_export import export_checkpoint
    from meshkit.core.io import parse_size

    try:
        limit = parse_size(max_shard_size)
    except ValueError as err:
        raise MeshkitError(f"--max-shard-size: {err}") from None
    index = export_checkpoint(checkpoint, out_dir, limit)
    Console().print(f"exported {checkpoint} -> [bold]{index}[/]")


app.command("estimate")(user_errors(estimate_command))
app.command("plan")(user_errors(plan_command))
bench_app = typer.Typer(help="Benchmarks: communication.")
app.add_typer(bench_app, name="bench")


@bench_app.command("comm")
@user_errors
def bench_comm(
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="ranks on this node")] = 2,
    sizes: Annotated[str, typer.Option("--sizes", help="bytes per call: 1M,16M,64M")] = "1M,16M,64M",
    ops: Annotated[str, typer.Option("--ops", help="all_reduce,all_gather,reduce_scatter,broadcast")] = ",".join(OPS),
    out: Annotated[Path, typer.Option("--out", help="JSON report")] = Path("comm_bench.json"),
    iters: Annotated[int, typer.Option("--iters", help="calls per timing; 0 = by size (5 to 200)")] = 0,
    profile: Annotated[
        Optional[Path], typer.Option("--profile", help="also probe matmul rate and memory; write a profile for plan")
    ] = None,
) -> None:
    """Time, algbw and busbw per collective and size (busbw as nccl-tests defines it), against a bare loop;
    with --profile, a device profile `meshkit plan --profile` reads."""
    parsed = parse_sizes(sizes)
    chosen = parse_ops(ops)
    if profile is not None and "all_reduce" not in chosen:
        ops = ",".join([*chosen, "all_reduce"])  # the profile's link bandwidth
    args: tuple[str, ...] = (
        "--ops",
        ops,
        "--sizes",
        ",".join(map(str, parsed)),
        "--out",
        str(out.absolute()),
        "--iters",
        str(iters),
    )
    if profile is not None:
        args += ("--profile", str(profile.absolute()))
    target = LaunchTarget("meshkit.planning.commbench", args, module=True)
    raise typer.Exit(launch(target, LaunchPlan(LaunchSettings(nproc_per_node=nproc_per_node))))


@app.command("env")
@user_errors
def env_command(config_file: ConfigFileOpt = None) -> None:
    """Versions, devices, backends and the resolved config, for bug reports."""
    from meshkit.cli.env import environment_rows

    table = Table(title="meshkit environment", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for name, value in environment_rows():
        table.add_row(name, value)
    Console().print(table)
    print_resolved(resolve(flags={}, file=config_file))


def main() -> None:
    app(prog_name="meshkit")


if __name__ == "__main__":
    main()
