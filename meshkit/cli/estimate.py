"""`meshkit estimate`: the memory estimator on the command line (a table with formulas, or JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional, cast

import typer
from rich.console import Console
from rich.table import Table

from meshkit.cli.config_run import run_values
from meshkit.cli.recipe_options import (
    AttentionOpt,
    CompileOpt,
    LossOpt,
    OptimizerStepOpt,
    TiledMlpOpt,
    WeightsOpt,
    step_recipe,
)
from meshkit.config.layout import Offload, Recompute
from meshkit.planning.estimate import (
    Estimate,
    EstimateError,
    ModelShape,
    Optimizer,
    Precision,
    Reference,
    as_table_rows,
    estimate_memory,
)

# The model options `meshkit estimate` and `meshkit plan` share.
ModelArg = Annotated[Optional[Path], typer.Argument(help="HF config.json or meshkit YAML")]
ParamsOpt = Annotated[Optional[float], typer.Option("--params", help="parameter count, e.g. 7.5e9")]
LayersOpt = Annotated[Optional[int], typer.Option("--layers")]
HiddenOpt = Annotated[Optional[int], typer.Option("--hidden")]
HeadsOpt = Annotated[Optional[int], typer.Option("--heads")]
VocabOpt = Annotated[Optional[int], typer.Option("--vocab")]


def model_shape(
    model: Path | None,
    params: float | None,
    layers: int | None,
    hidden: int | None,
    heads: int | None,
    vocab: int | None,
) -> ModelShape:
    """From a Hugging Face config.json, a meshkit YAML (its `model` section), or --params and shape flags."""
    if model is not None:
        if not model.is_file():
            raise EstimateError(f"model config {model} does not exist")
        if model.suffix == ".json":
            return ModelShape.from_hf_config(model)
        from meshkit.config.resolve import resolve

        return ModelShape.from_gpt(resolve(file=model).config.model)
    if params is None:
        raise EstimateError(
            "give a model: a config.json or meshkit YAML, or --params 7.5e9 [--layers --hidden --heads]"
        )
    if layers and hidden and heads:
        shape = ModelShape.transformer(layers=layers, hidden=hidden, heads=heads, vocab=vocab or 0)
        return ModelShape(params, layers, hidden, heads, vocab, shape.largest_layer_params)
    return ModelShape(params, layers, hidden, heads, vocab)


# what `meshkit estimate` assumes of a run where neither a flag nor a config says
DEFAULTS: dict[str, Any] = {
    "seq_len": 2048, "micro_batch": 1, "precision": "bf16", "optimizer": "adam", "zero_stage": 0, "dp": 1, "tp": 1,
    "pp": 1, "cp": 1, "ep": 1, "activation_checkpointing": "none", "offload": "none", "reference": "none",
    "compiled": False, "attention": "sdpa", "loss": "plain", "sequence_parallel": None, "trainable_params": None,
    "runtime_gb": 0.0, "tiled_mlp": False,
}  # fmt: skip

CPU_RUNTIME = "a CPU rank's runtime outside tensors (torch's kernels, gloo, the loop's objects; measured)"


def estimate_command(
    model: ModelArg = None,
    params: ParamsOpt = None,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    vocab: VocabOpt = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="default: the config's, else 2048")] = None,
    micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", help="default: the config's, else 1")] = None,
    precision: Annotated[Optional[str], typer.Option("--precision", help="fp32, bf16 or fp16")] = None,
    optimizer: Annotated[
        Optional[str],
        typer.Option("--optimizer", help="adam, adam8bit (8-bit states), adam4bit (torchao's 4-bit states) or sgd"),
    ] = None,
    zero_stage: Annotated[Optional[int], typer.Option("--zero-stage")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp")] = None,
    tp: Annotated[Optional[int], typer.Option("--tp")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp")] = None,
    cp: Annotated[Optional[int], typer.Option("--cp")] = None,
    ep: Annotated[
        Optional[int], typer.Option("--ep", help="expert parallel: experts split over this many dp·cp ranks")
    ] = None,
    activation_checkpointing: Annotated[
        Optional[str], typer.Option("--activation-checkpointing", help="none, selective or full")
    ] = None,
    offload: Annotated[Optional[str], typer.Option("--offload", help="none, cpu or nvme")] = None,
    ps_servers: Annotated[
        int, typer.Option("--ps-servers", help="parameter server: this many servers, --dp workers (0 = off)")
    ] = 0,
    runtime_gb: Annotated[
        Optional[float],
        typer.Option(
            "--runtime-gb",
            help="held outside tensors: CUDA context, workspaces (default 0; a config's run on CPU ranks: "
            "torch's measured CPU runtime)",
        ),
    ] = None,
    reference: Annotated[
        Optional[str],
        typer.Option(
            "--reference",
            help="preference training's reference model: copy (a frozen copy), adapters (LoRA's base), "
            "precomputed, or none",
        ),
    ] = None,
    compiled: CompileOpt = None,
    attention: AttentionOpt = None,
    loss: LossOpt = None,
    tiled_mlp: TiledMlpOpt = None,
    optimizer_step: OptimizerStepOpt = "foreach",
    weights: WeightsOpt = "autocast",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Memory per device (GB = 10^9 bytes): params, grads, optimizer, activations, buffers, with formulas. Given a
    run's config (a meshkit or fine-tune YAML), the run that config starts: its layout, precision, sequence,
    micro-batch, adapter and loss (flags override them)."""
    given = {"seq_len": seq_len, "micro_batch": micro_batch, "precision": precision, "optimizer": optimizer,
             "zero_stage": zero_stage, "dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
             "activation_checkpointing": activation_checkpointing, "offload": offload, "reference": reference,
             "compiled": compiled, "attention": attention, "loss": loss, "runtime_gb": runtime_gb,
             "tiled_mlp": tiled_mlp}  # fmt: skip
    run, v, sources = run_values(model, given, DEFAULTS)
    shape = run.shape if run is not None else model_shape(model, params, layers, hidden, heads, vocab)
    for name, value, choices in (
        ("--precision", v["precision"], ("fp32", "bf16", "fp16")),
        ("--optimizer", v["optimizer"], ("adam", "adam8bit", "adam4bit", "sgd")),
        ("--activation-checkpointing", v["activation_checkpointing"], ("none", "selective", "full")),
        ("--offload", v["offload"], ("none", "cpu", "nvme")),
        ("--reference", v["reference"], ("none", "copy", "adapters", "precomputed")),
    ):
        if value not in choices:
            raise EstimateError(f"{name} {value}: choose {', '.join(choices)}")
    recipe = step_recipe(v["compiled"], v["attention"], v["loss"], optimizer_step, weights, v["tiled_mlp"])
    if ps_servers:
        _parameter_server(
            shape, ps_servers, v["dp"], v["seq_len"], v["micro_batch"], v["precision"], v["optimizer"],
            v["activation_checkpointing"], as_json,
        )  # fmt: skip
        return
    estimate = estimate_memory(
        shape,
        seq_len=v["seq_len"],
        micro_batch=v["micro_batch"],
        precision=cast(Precision, v["precision"]),
        optimizer=cast(Optimizer, v["optimizer"]),
        zero_stage=v["zero_stage"],
        dp=v["dp"],
        tp=v["tp"],
        pp=v["pp"],
        cp=v["cp"],
        activation_checkpointing=cast(Recompute, v["activation_checkpointing"]),
        offload=cast(Offload, v["offload"]),
        sequence_parallel=v["sequence_parallel"],
        runtime_gb=v["runtime_gb"],
        runtime_words="given" if sources["runtime_gb"] == "flag" else CPU_RUNTIME,
        ep=v["ep"],
        reference=cast(Reference, v["reference"]),
        recipe=recipe,
        trainable_params=v["trainable_params"],
    )
    if as_json:
        out = estimate.as_json()
        out["run"] = {name: {"value": v[name], "from": sources[name]} for name in DEFAULTS}
        print(json.dumps(out, indent=2))
        return
    console = Console()
    if run is not None:
        console.print(
            f"the run {run.path} starts ({run.recipe}); flags override: {_from_flags(sources)}", highlight=False
        )
    console.print(_table(_title(v, recipe), estimate))
    if shape.expert_params:
        ep_size = v["ep"]
        held = (
            f"each rank holds 1/{ep_size} of the experts"
            if ep_size > 1
            else "every rank holds every expert (--ep: split)"
        )
        console.print(
            f"mixture of experts: {_count(shape.params)} parameters, {_count(shape.active_params)} active per token "
            f"({shape.active_expert_fraction:.0%} of the {_count(shape.expert_params)} in experts); {held}",
            highlight=False,
            soft_wrap=True,
        )


def _from_flags(sources: dict[str, str]) -> str:
    flags = [name.replace("_", "-") for name, source in sources.items() if source == "flag"]
    return ", ".join(flags) if flags else "none given"


def _title(v: dict[str, Any], recipe: Any) -> str:
    """`memory per device — dp=2 tp=2 pp=1 cp=1, ZeRO-0, fp32, seq 128 × micro-batch 8; plain loss, eager, sdpa`."""
    layout = f"dp={v['dp']} tp={v['tp']} pp={v['pp']} cp={v['cp']}" + (f" ep={v['ep']}" if v["ep"] > 1 else "")
    sp = ", sequence parallel" if v["sequence_parallel"] and v["tp"] > 1 else ""
    adapters = f", {_count(v['trainable_params'])} trained (adapters)" if v["trainable_params"] else ""
    recompute = f", recompute {v['activation_checkpointing']}" if v["activation_checkpointing"] != "none" else ""
    return (
        f"memory per device: {layout}{sp}, ZeRO-{v['zero_stage']}, {v['precision']}, seq {v['seq_len']} × "
        f"micro-batch {v['micro_batch']}{adapters}{recompute}; {recipe.describe()}"
    )


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


def _table(title: str, estimate: Estimate) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("item", "GB", "formula"):
        table.add_column(column, justify="right" if column == "GB" else "left")
    for row in as_table_rows(estimate):
        table.add_row(*row)
    return table


def _parameter_server(
    shape: ModelShape,
    servers: int,
    workers: int,
    seq_len: int,
    micro_batch: int,
    precision: str,
    optimizer: str,
    recompute: str,
    as_json: bool,
) -> None:
    """A server's and a worker's memory, and the traffic per step against ring all-reduce at the same world."""
    from meshkit.planning.estimate_ps import server_memory, traffic, worker_memory

    server = server_memory(shape, cast(Optimizer, optimizer), servers, workers)
    worker = worker_memory(
        shape,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=cast(Precision, precision),
        activation_checkpointing=cast(Recompute, recompute),
    )
    moved = traffic(shape, servers, workers)
    if as_json:
        print(
            json.dumps({"server": server.as_json(), "worker": worker.as_json(), "traffic": moved.as_json()}, indent=2)
        )
        return
    console = Console()
    console.print(_table(f"memory of one parameter server ({servers} servers, {workers} workers)", server))
    console.print(_table("memory of one worker", worker))
    console.print(
        f"traffic per step: {moved.per_worker_gb:.3f} GB per worker (2Ψ: gradients pushed, parameters pulled), "
        f"{moved.per_server_gb:.3f} GB through each server (2Ψ·W/S); ring all-reduce on the same "
        f"{servers + workers} ranks: {moved.ring_per_rank_gb:.3f} GB per rank (2Ψ(N-1)/N)"
    )
