"""The one training loop every recipe shares.

A recipe sets up (model, optimizer, data), hands `run_steps` its prepared loader and scheduler, a `StepLoss` (how
the micro-steps' losses of one optimizer step become the step's loss) and a `LoopPlan` (how many steps, when to
evaluate and checkpoint, when to stop); the loop owns stepping, accumulation windows, evaluation and checkpoint
cadence, resume, preemption, the progress bar and the rows every summary has. The recipe adds its own rows.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from meshkit.data.loader import endless
from meshkit.engine.engine import Engine
from meshkit.engine.what_ran import one_line, what_ran
from meshkit.engine.where_it_runs import where_it_runs
from meshkit.recipes.report import TrainingProgress, plot_losses
from meshkit.runtime.memory import peak_rss_bytes
from meshkit.training.stopping import EarlyStopping, LossWatchdog


class StepLoss(Protocol):
    """Collects the losses of an optimizer step's micro-steps and gives the step's loss (the same on every rank
    that reports)."""

    def add(self, loss: torch.Tensor, batch: Any) -> None: ...

    def mean(self) -> float: ...

    def metrics(self) -> dict[str, float]:
        """The step's further metrics (logged beside the loss); called after `mean`."""
        ...


class MeanStepLoss:
    """The mean of the micro-steps' losses, averaged over the data-parallel ranks — or this rank's own where the
    ranks never meet (asynchronous parameter-server workers)."""

    def __init__(self, engine: Engine, micro_steps: int, shared: bool = True) -> None:
        self.engine, self.micro_steps, self.shared = engine, micro_steps, shared
        self.total = torch.zeros((), device=engine.device)

    def add(self, loss: torch.Tensor, batch: Any) -> None:
        self.total += loss

    def mean(self) -> float:
        mean = self.total / self.micro_steps
        value = (self.engine.reduce(mean) if self.shared else mean).item()
        self.total.zero_()
        return value

    def metrics(self) -> dict[str, float]:
        return {}


@dataclass(frozen=True)
class LoopPlan:
    """What a recipe asks of the loop. `evaluate` runs every `eval_every` steps and at the end; a checkpoint is
    written every `save_every` steps (besides `checkpoint.every_steps`) and at the end when either is set."""

    total_steps: int
    tokens_per_step: float
    evaluate: Callable[[], dict[str, float]] | None = None
    eval_every: int | None = None
    save_every: int | None = None
    watchdog: LossWatchdog | None = None
    early_stopping: EarlyStopping | None = None
    measure_activations: bool = False  # the first micro-step's activations, for the summary
    step: Callable[[Any], torch.Tensor] | None = None  # a micro-step other than `engine.train_step`
    before_step: Callable[[int], None] | None = None  # called with the step's number before its first micro-step


@dataclass
class LoopRecord:
    """What the loop did: the loss of every step (a resumed run's earlier steps included), the evaluations, and
    what the summary reports. Its `losses` and `evals` travel in each checkpoint, so a resumed run goes on."""

    losses: list[float]
    evals: list[dict[str, float]]
    first_step: int
    tokens_per_step: float
    stopped_early: bool = False
    wall_s: float = 0.0
    activations: dict[str, Any] | None = None
    reports_stopping: bool = field(default=False, repr=False)
    metrics: list[dict[str, float]] = field(default_factory=list)  # the step loss's further metrics, per step

    @classmethod
    def resumed_from(cls, extra: dict[str, Any] | None, tokens_per_step: float) -> LoopRecord:
        losses = list((extra or {}).get("losses", []))
        record = cls(losses, list((extra or {}).get("evals", [])), len(losses), tokens_per_step)
        record.metrics = list((extra or {}).get("metrics", []))
        return record

    @property
    def step(self) -> int:
        return len(self.losses)

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"losses": self.losses, "evals": self.evals, "metrics": self.metrics}

    def rows(
        self, engine: Engine, layout_description: str, every_rank: Callable[[Any], list[Any]] | None = None
    ) -> dict[str, Any]:
        """The rows every recipe's summary starts with; `ran`, the record of what ran, gathers every rank's share
        of the parameters with `every_rank` (a collective), else this rank's."""
        trained = self.step - self.first_step
        rows: dict[str, Any] = {
            "final_loss": self.losses[-1],
            "first_loss": self.losses[0],
            "steps": self.step,
            "resumed_at_step": self.first_step,
        }
        if self.reports_stopping:
            rows["stopped_early"] = self.stopped_early
        return rows | {
            "tokens_per_s": trained * self.tokens_per_step / self.wall_s if trained else 0.0,
            "wall_s": self.wall_s,
            "world_size": engine.num_processes,
            "layout": engine.mesh.dims.as_dict(),
            "layout_description": layout_description,
            "precision": engine.config.precision,
            "zero_stage": engine.zero_stage,
            **where_it_runs(engine),  # device, backend, attention
            "compile": engine.ctx.objects.compiled,  # off, whole model, per block (N blocks)
            "ran": what_ran(engine, every_rank),
        }


def chained_hooks(*hooks: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """One `before_step` hook calling each given one in order (None when none is given)."""
    present = [hook for hook in hooks if hook is not None]
    if len(present) < 2:
        return present[0] if present else None

    def each(step: int) -> None:
        for hook in present:
            hook(step)

    return each


def run_steps(engine: Engine, loader: Iterable[Any], scheduler: Any, plan: LoopPlan, loss: StepLoss) -> LoopRecord:
    """Train until `plan.total_steps` optimizer steps (counting a resumed run's) or an early stop; returns the
    record. Resumes from `checkpoint.resume`, checkpoints on preemption and at the cadence asked."""
    record = LoopRecord.resumed_from(engine.resume(), plan.tokens_per_step)  # data position, RNG, optimizer, ...
    record.reports_stopping = plan.early_stopping is not None
    if engine.is_main_worker:
        print(f"meshkit: runs with {one_line(what_ran(engine, stepped=False))}", flush=True)
    engine.checkpoints.arm_preemption()  # save_checkpoint() ends every step: a signal in step 1 checkpoints too
    batches = endless(loader)
    micro_step = plan.step or engine.train_step
    activations = engine.activation_report() if plan.measure_activations else None
    measuring: Any = activations if activations is not None else contextlib.nullcontext()
    start = time.perf_counter()
    with TrainingProgress(plan.total_steps, enabled=engine.is_main_worker) as progress:
        progress.update(record.first_step, record.losses[-1] if record.losses else float("nan"), 0.0)
        begun = -1
        while record.step < plan.total_steps and not record.stopped_early:
            if plan.before_step is not None and begun != record.step:
                plan.before_step(record.step)
                begun = record.step
            batch = next(batches)
            with measuring:
                loss.add(micro_step(batch), batch)
            measuring = contextlib.nullcontext()  # the first micro-step only
            if not engine.sync_gradients:
                continue
            record.losses.append(loss.mean())
            further = loss.metrics()
            if further:
                record.metrics.append(further)
            _after_step(engine, scheduler, plan, record, progress, start)
    if record.stopped_early and plan.early_stopping is not None:
        engine.print(
            f"meshkit: early stopping at step {record.step}: no better eval loss in "
            f"{plan.early_stopping.patience} evaluations (best {plan.early_stopping.best:.4f})"
        )
    engine.wait_for_checkpoint()
    record.wall_s = time.perf_counter() - start
    engine.ctx.objects.train_peak_rss = peak_rss_bytes()  # (the training's peak, before evaluation and exports)
    if plan.evaluate is not None and (not record.evals or record.evals[-1]["step"] != record.step):
        record.evals.append({"step": record.step, **plan.evaluate()})
    record.activations = activations.as_dict() if activations is not None else None
    return record


def _after_step(
    engine: Engine, scheduler: Any, plan: LoopPlan, record: LoopRecord, progress: TrainingProgress, start: float
) -> None:
    """An optimizer step ended: watch the loss, show progress, evaluate, log and checkpoint when due."""
    step, loss = record.step, record.losses[-1]
    if plan.watchdog is not None:
        plan.watchdog.check(step, loss)
    tokens_per_s = (step - record.first_step) * plan.tokens_per_step / (time.perf_counter() - start)
    progress.update(step, loss, tokens_per_s)
    metrics = {"loss": loss, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_per_s}
    if len(record.metrics) == step:  # (the step loss's own, e.g. preference rewards)
        metrics.update(record.metrics[-1])
    if plan.evaluate is not None and plan.eval_every and (step % plan.eval_every == 0 or step == plan.total_steps):
        record.evals.append({"step": step, **plan.evaluate()})
        metrics.update(record.evals[-1])
        if plan.early_stopping is not None:
            record.stopped_early = plan.early_stopping.should_stop(record.evals[-1]["eval_loss"])
    last = step == plan.total_steps or record.stopped_early
    if step % engine.config.train.log_every == 0 or last:
        engine.log(metrics, step)
    save_every = plan.save_every
    due = (last and (engine.config.checkpoint.every_steps > 0 or bool(save_every))) or bool(
        save_every and step % save_every == 0
    )
    engine.save_checkpoint(extra=record.checkpoint_extra(), force=due)  # also when checkpoint.every_steps is due


def write_summary(
    engine: Engine,
    summary: dict[str, Any],
    losses: list[float],
    curve: list[tuple[float, float]] | None = None,
    shares: dict[str, list[tuple[float, float]]] | None = None,
) -> Path | None:
    """summary.json and loss.png in the run directory (main reporting rank only); returns the plot's path."""
    run_dir = Path(engine.config.logging.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return plot_losses(losses, run_dir / "loss.png", curve, shares)
