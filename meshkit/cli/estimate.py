"""`meshkit estimate`: the memory estimator on the command line (a table with formulas, or JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional, cast

import typer
from rich.console import Console
from rich.table import Table

from meshkit.cli.recipe_options import AttentionOpt, CompileOpt, LossOpt, OptimizerStepOpt, WeightsOpt, step_recipe
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


def estimate_command(
    model: ModelArg = None,
    params: ParamsOpt = None,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    vocab: VocabOpt = None,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 2048,
    micro_batch: Annotated[int, typer.Option("--micro-batch")] = 1,
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16 or fp16")] = "bf16",
    optimizer: Annotated[
        str, typer.Option("--optimizer", help="adam, adam8bit (8-bit states), adam4bit (torchao's 4-bit states) or sgd")
    ] = "adam",
    zero_stage: Annotated[int, typer.Option("--zero-stage")] = 0,
    dp: Annotated[int, typer.Option("--dp")] = 1,
    tp: Annotated[int, typer.Option("--tp")] = 1,
    pp: Annotated[int, typer.Option("--pp")] = 1,
    cp: Annotated[int, typer.Option("--cp")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="expert parallel: experts split over this many dp·cp ranks")] = 1,
    activation_checkpointing: Annotated[
        str, typer.Option("--activation-checkpointing", help="none, selective or full")
    ] = "none",
    offload: Annotated[str, typer.Option("--offload", help="none, cpu or nvme")] = "none",
    ps_servers: Annotated[
        int, typer.Option("--ps-servers", help="parameter server: this many servers, --dp workers (0 = off)")
    ] = 0,
    runtime_gb: Annotated[
        float,
        typer.Option("--runtime-gb", help="held outside tensors: CUDA context, workspaces (default 0)"),
    ] = 0.0,
    reference: Annotated[
        str,
        typer.Option(
            "--reference",
            help="preference training's reference model: copy (a frozen copy), adapters (LoRA's base), "
            "precomputed, or none",
        ),
    ] = "none",
    compiled: CompileOpt = False,
    attention: AttentionOpt = "sdpa",
    loss: LossOpt = "plain",
    optimizer_step: OptimizerStepOpt = "foreach",
    weights: WeightsOpt = "autocast",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Memory per device (GB = 10^9 bytes): params, grads, optimizer, activations, buffers, with formulas."""
    for name, value, choices in (
        ("--precision", precision, ("fp32", "bf16", "fp16")),
        ("--optimizer", optimizer, ("adam", "adam8bit", "adam4bit", "sgd")),
        ("--activation-checkpointing", activation_checkpointing, ("none", "selective", "full")),
        ("--offload", offload, ("none", "cpu", "nvme")),
        ("--reference", reference, ("none", "copy", "adapters", "precomputed")),
    ):
        if value not in choices:
            raise EstimateError(f"{name} {value}: choose {', '.join(choices)}")
    recipe = step_recipe(compiled, attention, loss, optimizer_step, weights)
    shape = model_shape(model, params, layers, hidden, heads, vocab)  # (the choices were checked above)
    if ps_servers:
        _parameter_server(
            shape, ps_servers, dp, seq_len, micro_batch, precision, optimizer, activation_checkpointing, as_json
        )
        return
    estimate = estimate_memory(
        shape,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=cast(Precision, precision),
        optimizer=cast(Optimizer, optimizer),
        zero_stage=zero_stage,
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        activation_checkpointing=cast(Recompute, activation_checkpointing),
        offload=cast(Offload, offload),
        runtime_gb=runtime_gb,
        ep=ep,
        reference=cast(Reference, reference),
        recipe=recipe,
    )
    if as_json:
        print(json.dumps(estimate.as_json(), indent=2))
        return
    Console().print(
        _table(
            f"memory per device (dp={dp} tp={tp} pp={pp} cp={cp}{f' ep={ep}' if ep > 1 else ''}, "
            f"ZeRO-{zero_stage}, {precision}; {recipe.describe()})",
            estimate,
        )
    )
    if shape.expert_params:
        held = f"each rank holds 1/{ep} of the experts" if ep > 1 else "every rank holds every expert (--ep: split)"
        Console().print(
            f"mixture of experts: {_count(shape.params)} parameters, {_count(shape.active_params)} active per token "
            f"({shape.active_expert_fraction:.0%} of the {_count(shape.expert_params)} in experts); {held}",
            highlight=False,
            soft_wrap=True,
        )


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


def _table(title: str, estimate: Estimate) -> Table:
    table = Table(title=title)
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
