"""The fine-tuning recipe: a transformers causal LM on JSONL data, full or LoRA, in any layout.

`meshkit finetune CONFIG.yaml [key=value ...]` runs it (launching itself on `launch.nproc_per_node` ranks);
under a launcher it is `python -m meshkit.recipes.finetune CONFIG.yaml [key=value ...]`. The config takes
Axolotl keys (see `finetune_config`). Outputs in `output_dir`: the LoRA adapter in peft's format at the root,
the merged model (or the fully fine-tuned one) in `merged/`, plus `summary.json`, `metrics.jsonl`, `loss.png`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshkit.config.layout import Layout
from meshkit.config.schema import RunConfig
from meshkit.engine.engine import Engine
from meshkit.engine.what_ran import note_ran
from meshkit.engine.where_it_runs import where_words
from meshkit.parallel.pipeline.stages import forward_only_refusal
from meshkit.recipes import schemes
from meshkit.recipes.finetune_config import FinetuneJob, resolve_finetune
from meshkit.recipes.finetune_setup import (
    FinetuneError,
    FinetuneModel,
    StepPlan,
    adapt,
    adapter_words,
    load_base,
    make_optimizer,
    make_schedule,
    rebuild_whole,
    start_adapters,
    step_plan,
)
from meshkit.recipes.hf_base import replace_directory, weights_file, write_tokenizer
from meshkit.recipes.loop import LoopPlan, LoopRecord, run_steps, write_summary
from meshkit.recipes.preference_training import PreferenceTraining
from meshkit.recipes.report import print_summary
from meshkit.recipes.supervised_training import SupervisedTraining
from meshkit.recipes.training_kind import TrainingKind
from meshkit.runtime import collectives
from meshkit.training.stopping import EarlyStopping, LossWatchdog
from meshkit.tuning.lora import AdapterExport, continued_weights, save_adapter
from meshkit.tuning.untrained_tokens import fix_untrained_tokens

__all__ = ["FinetuneError", "check_layout", "finetune", "main"]


def check_layout(cfg: RunConfig, dims: Layout, job: FinetuneJob) -> None:
    """What this recipe's data cannot do in the layout `dims`, said before any work (the launcher asks too, for
    every layout the job may have, before any worker starts)."""
    packing, cp, pp, tp = job.settings.sample_packing, dims.cp, dims.pp, dims.tp
    if job.settings.streams and not job.steps_given():
        raise FinetuneError(
            "streamed data (streaming: true, pretraining_dataset) needs max_steps: a stream's length is not known"
        )
    if cfg.strategy != "auto":  # its evaluation, exports and generations meet every rank in collectives
        raise FinetuneError(
            f"meshkit finetune runs the layouts of strategy=auto (DDP, ZeRO, tp, pp, cp), not strategy={cfg.strategy}: "
            "drop strategy, or drive that strategy from your own script with meshkit.Engine"
        )
    evaluates = bool(job.settings.val_set_size or job.settings.test_datasets)
    refusal = (
        forward_only_refusal(cfg.pipeline.schedule, "evaluation (val_set_size, test_datasets)") if pp > 1 else None
    )
    if evaluates and refusal is not None:
        raise FinetuneError(refusal)
    if job.settings.lora_modules_to_save and (tp > 1 or pp > 1):
        raise FinetuneError(
            "lora_modules_to_save wraps whole modules, which tensor and pipeline parallel do not split yet: set "
            "tp=1 and pp=1, or drop lora_modules_to_save"
        )
    if job.settings.qat is not None and tp > 1:
        raise FinetuneError(
            "qat: torchao's fake-quantized layers do not split over tensor parallel: set tp=1 (ZeRO and pp run it)"
        )
    if job.settings.peft_use_dora and tp > 1:
        raise FinetuneError(
            "DoRA rescales whole output rows, which tensor parallel splits: set tp=1 or peft_use_dora: false"
        )
    if packing and cfg.train.seq_len % max(1, 2 * cp):
        raise FinetuneError(f"sequence_len={cfg.train.seq_len} must be a multiple of 2 × cp")


def finetune(job: FinetuneJob) -> dict[str, Any]:
    """Run the recipe; returns the summary (also written to summary.json on the main process)."""
    with Engine(job.resolved) as engine:
        return _finetune(engine, job)


def training_kind(job: FinetuneJob) -> TrainingKind:
    """The kind of training the config asks for: `rl:` a preference method, `reward_model` or
    `process_reward_model` (preference training's data and objectives), else supervised fine-tuning."""
    s = job.settings
    if s.rl is not None or s.reward_model or s.process_reward_model:
        return PreferenceTraining(job)
    return SupervisedTraining(job)


def _finetune(engine: Engine, job: FinetuneJob) -> dict[str, Any]:
    """The one set-up and run of every kind: the kind brings its data and objective, the rest is shared."""
    cfg, s = engine.config, job.settings
    for note in job.notes:
        engine.print(f"meshkit: {note}")
    check_layout(engine.config, engine.mesh.dims, job)
    why = schemes.refusal(engine.zero_stage, engine.mesh.dims.tp, s)
    if why is not None:
        raise FinetuneError(why)
    kind = training_kind(job)
    base, tokenizer, attention = load_base(engine, job)
    kind.load_data(engine, tokenizer)
    built = adapt(job, base, tokenizer, attention)
    for note in built.notes:
        engine.print(f"meshkit: {note}")
    steps = step_plan(engine, job, kind.rows)
    optimizer = make_optimizer(built.model, job, engine)
    scheduler, warmup = make_schedule(engine, job, optimizer, steps.total_steps)
    continued = (
        continued_weights(s.lora_model_dir, built.model) if s.lora_model_dir and built.peft_model is not None else None
    )
    model_class = type(base).__name__  # (before prepare: FSDP2 renames a sharded module's class FSDP<name>)
    before_step = schemes.before_step_hook(engine, s, built.model)  # (facts of the model before it is prepared)
    kind.before_prepare(engine, built)
    model, optimizer, loader, scheduler = engine.prepare(built.model, optimizer, kind.loader, scheduler)
    start_adapters(engine, job, built)  # (before a reference is scored)
    if s.fix_untrained_tokens and not s.streams:  # (before the reference and a resumed checkpoint, which holds them)
        line = fix_untrained_tokens(built.model, s.fix_untrained_tokens, weights_file(s.base_model), kind.token_ids())
        engine.print(f"meshkit: {line}")
    kind.after_prepare(engine, model, built)
    if continued is not None:  # into this rank's shards; a resumed checkpoint (below) still comes last
        engine.load_full_state_dict(continued)
        engine.print(f"meshkit: continuing the adapter in {s.lora_model_dir} ({len(continued)} tensors)")
    _start_wandb(engine, s)
    _announce(engine, kind, built, model_class, steps.total_steps, adapter_words(s))
    plan = LoopPlan(
        steps.total_steps, kind.tokens_per_row * steps.rows_per_step, evaluate=kind.evaluation(engine, model),
        eval_every=steps.eval_every, save_every=steps.save_every,
        watchdog=LossWatchdog(s.loss_watchdog_threshold, s.loss_watchdog_patience),
        early_stopping=EarlyStopping(s.early_stopping_patience), step=kind.micro_step(), before_step=before_step,
    )  # fmt: skip
    record = run_steps(engine, loader, scheduler, plan, kind.step_loss(engine))
    base.config.use_cache = True  # training turned it off; generation wants it
    outputs = _write_outputs(engine, tokenizer, None if s.relora else rebuild_whole(job, built))
    summary = _summary(engine, job, kind, record, built, steps, warmup, outputs)
    if engine.is_main_process:
        curve, shares = kind.plot_curves(record)
        plot = write_summary(engine, summary, record.losses, curve, shares)
        _print(summary, Path(cfg.logging.dir), plot, *kind.table_rows(summary))
    return summary


def _announce(
    engine: Engine, kind: TrainingKind, built: FinetuneModel, model_class: str, steps: int, adapter: str
) -> None:
    what, data_words, notes = kind.banner(engine)
    engine.print(
        f"meshkit: {what} {model_class} ({built.parameters / 1e6:.2f}M params, {built.trainable / 1e6:.3f}M "
        f"trainable{adapter}) on {engine.num_processes} rank(s), layout "
        f"{engine.mesh.dims.describe()}; {data_words}, {steps} steps; {where_words(engine)}"
    )
    for note in notes:
        engine.print(f"meshkit: {note}")
    note_ran(engine, "objective", f"{kind.name}: {kind.objective_words()}")


def _summary(
    engine: Engine,
    job: FinetuneJob,
    kind: TrainingKind,
    record: LoopRecord,
    built: FinetuneModel,
    steps: StepPlan,
    warmup: int,
    outputs: dict[str, str],
) -> dict[str, Any]:
    """The loop's rows, the fine-tune's, then the kind's own."""
    s = job.settings
    rows = record.rows(engine, engine.mesh.dims.describe(), lambda value: collectives.gather_object(value, group=None))
    # passes over the data the steps made (a step may read more rows than a small packed dataset holds)
    rows["epochs"] = record.step * steps.rows_per_step / max(1, kind.rows)
    return rows | {
        "objective": kind.name,
        "adapter": s.adapter,
        "optimizer": s.optimizer,
        "warmup_steps": warmup,
        "parameters": built.parameters,
        "trainable_parameters": built.trainable,
        "losses": record.losses,
        "evals": record.evals,
        "outputs": outputs,
        "memory": collectives.gather_object(engine.memory_report(), group=None),
        **kind.summary_rows(engine, record, outputs),
    }


def _start_wandb(engine: Engine, s: Any) -> None:
    """The wandb_* keys into the wandb tracker's start (when the tracker runs)."""
    if "wandb" not in engine.config.logging.trackers:
        return
    options = {"entity": s.wandb_entity, "name": s.wandb_name, "id": s.wandb_run_id, "mode": s.wandb_mode}
    engine.start_trackers(s.wandb_project or "meshkit", init_kwargs={"wandb": {k: v for k, v in options.items() if v}})


def _write_outputs(engine: Engine, tokenizer: Any, lora_model: AdapterExport | None) -> dict[str, str]:
    """The adapter (LoRA) at the output root; the merged model in `merged/`, swapped in once complete."""
    out = Path(engine.config.logging.dir)
    outputs: dict[str, str] = {}
    if lora_model is not None:
        save_adapter(engine, lora_model, out)
        if engine.is_main_process:
            write_tokenizer(tokenizer, out)
        outputs["adapter"] = str(out)
    staging = out / ".merged-partial"
    engine.save_model(staging)
    if engine.is_main_process:
        write_tokenizer(tokenizer, staging)
        replace_directory(staging, out / "merged")
    engine.wait_for_everyone()
    outputs["merged"] = str(out / "merged")
    return outputs


def _print(
    summary: dict[str, Any], run_dir: Path, plot: Path | None, title: str, kind_rows: list[tuple[str, str]]
) -> None:
    print_summary(summary, run_dir, plot)
    table = Table(title=title, show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("trainable", f"{summary['trainable_parameters']:,} of {summary['parameters']:,}")
    for name, value in kind_rows:
        table.add_row(name, value)
    for name, path in summary["outputs"].items():
        table.add_row(name, path)
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m meshkit.recipes.finetune CONFIG.yaml [key=value ...]")
    finetune(resolve_finetune(argv[0], argv[1:]))


if __name__ == "__main__":
    main()
