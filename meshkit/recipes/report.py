"""What the recipe shows a person: a progress bar during training, a summary table and a loss plot after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class TrainingProgress:
    """A rich progress bar with step, loss and tokens/s (a no-op on ranks other than the main one)."""

    def __init__(self, total_steps: int, enabled: bool) -> None:
        self._progress = (
            Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TextColumn("{task.fields[tokens_per_s]:,.0f} tok/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            if enabled
            else None
        )
        self._task = (
            self._progress.add_task("train", total=total_steps, loss=float("nan"), tokens_per_s=0.0)
            if self._progress
            else None
        )

    def __enter__(self) -> TrainingProgress:
        if self._progress:
            self._progress.start()
        return self

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, loss=loss, tokens_per_s=tokens_per_s)

    def __exit__(self, *exc: Any) -> None:
        if self._progress:
            self._progress.stop()


def plot_losses(
    losses: list[float],
    path: Path,
    evals: list[tuple[float, float]] | None = None,
    shares: dict[str, list[tuple[float, float]]] | None = None,
) -> Path | None:
    """Loss per step (and the evaluation loss at its steps) as a PNG, with `shares` (curves between 0 and 1,
    e.g. preference accuracy) on a second axis; None when matplotlib is not installed (pip install 'meshkit[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(range(1, len(losses) + 1), losses, linewidth=1.2, label="train")
    if evals:
        axes.plot([step for step, _ in evals], [loss for _, loss in evals], marker="o", linewidth=1.2, label="eval")
        axes.legend()
    if shares:
        second = axes.twinx()
        for name, points in shares.items():
            second.plot([x for x, _ in points], [y for _, y in points], linestyle="--", linewidth=1.0, label=name)
        second.set_ylim(-0.05, 1.05)
        second.set_ylabel(", ".join(shares))
        second.legend(loc="center right")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (mean over dp ranks)")
    axes.set_title("meshkit training loss")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def print_summary(summary: dict[str, Any], run_dir: Path, plot: Path | None) -> None:
    table = Table(title="meshkit run summary", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("layout", f"{summary['layout_description']} ({summary['world_size']} ranks)")
    ran = summary.get("ran", {})
    for name in ("device", "backend", "attention", "compile"):
        if name in ran or name in summary:
            table.add_row(name, str(ran.get(name, summary.get(name))))
    for key, words in summary.get("ran", {}).items():
        if key == "parameters":
            table.add_row("parameters held", parameters_row(words))
        elif key not in ("attention", "compile"):
            table.add_row("loss path" if key == "loss" else key.replace("_", " "), str(words))
    table.add_row("zero stage", str(summary["zero_stage"]))
    table.add_row("precision", summary["precision"])
    table.add_row("steps", str(summary["steps"]))
    table.add_row("loss", f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}")
    table.add_row("tokens/s", f"{summary['tokens_per_s']:,.0f}")
    table.add_row("wall time", f"{summary['wall_s']:.1f} s")
    if "activations" in summary:
        table.add_row("activations kept", activations_row(summary))
    if "params_sha256" in summary:
        table.add_row("params sha256", summary["params_sha256"][:16] + "...")
    table.add_row("summary", str(run_dir / "summary.json"))
    table.add_row("loss plot", str(plot) if plot else "not drawn: pip install 'meshkit[plot]'")
    Console().print(table)
    Console().print(memory_table(summary["memory"]))


def parameters_row(shares: list[dict[str, Any]]) -> str:
    """`50.0 % / 50.0 % of 1,234,567 (tp-split layers: 50.0 % / 50.0 %)`: each rank's share of the parameters."""
    words = " / ".join(f"{share['share'] * 100:.1f} %" for share in shares) + f" of {shares[0]['whole']:,}"
    if all("tp_split" in share for share in shares):
        split = " / ".join(f"{share['tp_held'] / share['tp_split'] * 100:.1f} %" for share in shares)
        words += f" (tp-split layers: {split})"
    return words


def activations_row(summary: dict[str, Any]) -> str:
    """Largest per-rank activation bytes of the measured step, and the checkpointing that gave them."""
    peak = max(report["peak_bytes"] for report in summary["activations"])
    checkpointing = summary["activation_checkpointing"]
    mode = checkpointing["mode"] + (f", every {checkpointing['every']}" if checkpointing["every"] > 1 else "")
    offload = ", offloaded to CPU" if summary["activation_offload"] else ""
    return f"{peak / 1e6:,.1f} MB per rank (checkpointing {mode}{offload})"


def memory_table(per_rank: list[dict[str, int]]) -> Table:
    """Per rank: bytes held for parameters, gradients, optimizer states, and resident memory."""
    table = Table(title="memory per rank after the last step (MB)")
    for column in ("rank", "params", "grads", "optimizer", "rss", "peak rss"):
        table.add_column(column, justify="right")
    for index, report in enumerate(per_rank):
        values = (report[k] / 1e6 for k in ("params", "grads", "optimizer", "rss", "peak_rss"))
        table.add_row(str(report.get("rank", index)), *(f"{v:,.1f}" for v in values))
    return table
