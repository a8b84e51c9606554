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
from meshkit.data.formats import end_of_turn_ids
from meshkit.engine.engine import Engine
from meshkit.engine.where_it_runs import where_words
from meshkit.parallel.pipeline.schedule import forward_only_refusal
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
from meshkit.recipes.hf_base import generate_samples, prompt_ids, replace_directory, weights_file, write_tokenizer
from meshkit.recipes.instruction_data import prepare_data
from meshkit.recipes.loop import LoopPlan, LoopRecord, run_steps, write_summary
from meshkit.recipes.preference_run import train_preference
from meshkit.recipes.report import print_summary
from meshkit.recipes.streaming_data import prepare_stream
from meshkit.recipes.validation import WindowLoss, eval_batches, evaluate
from meshkit.runtime import collectives
from meshkit.training.loss import IGNORE_INDEX
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


def _finetune(engine: Engine, job: FinetuneJob) -> dict[str, Any]:
    cfg, s = engine.config, job.settings
    for note in job.notes:
        engine.print(f"meshkit: {note}")
    check_layout(engine.config, engine.mesh.dims, job)
    why = schemes.refusal(engine.zero_stage, engine.mesh.dims.tp, s)
    if why is not None:
        raise FinetuneError(why)
    base, tokenizer, attention = load_base(engine, job)
    if s.rl is not None or s.reward_model or s.process_reward_model:
        return train_preference(engine, job, base, tokenizer, attention, _write_outputs)
    data: Any = (
        prepare_stream(engine, s, tokenizer, cfg.train.steps) if s.streams else prepare_data(engine, s, tokenizer)
    )
    built = adapt(job, base, tokenizer, attention)
    for note in built.notes:
        engine.print(f"meshkit: {note}")
    steps = step_plan(engine, job, data.row_count)
    optimizer = make_optimizer(built.model, job, engine)
    scheduler, warmup = make_schedule(engine, job, optimizer, steps.total_steps)
    continued = (
        continued_weights(s.lora_model_dir, built.model) if s.lora_model_dir and built.peft_model is not None else None
    )
    model_class = type(base).__name__  # (before prepare: FSDP2 renames a sharded module's class FSDP<name>)
    before_step = schemes.before_step_hook(engine, s, built.model)  # (facts of the model before it is prepared)
    model, optimizer, loader, scheduler = engine.prepare(built.model, optimizer, data.loader, scheduler)
    start_adapters(engine, job, built)
    schemes.weigh_tokens(engine, s)
    if s.fix_untrained_tokens and not s.streams:  # (before a resumed checkpoint, which holds the fixed rows)
        line = fix_untrained_tokens(built.model, s.fix_untrained_tokens, weights_file(Path(s.base_model)), data.train)
        engine.print(f"meshkit: {line}")
    if continued is not None:  # into this rank's shards; a resumed checkpoint (below) still comes last
        engine.load_full_state_dict(continued)
        engine.print(f"meshkit: continuing the adapter in {s.lora_model_dir} ({len(continued)} tensors)")
    _start_wandb(engine, s)
    _announce(engine, job, built, data, model_class, steps.total_steps)
    val = eval_batches(data.validation, engine, data.collate, s.eval_batch_size)
    plan = LoopPlan(
        steps.total_steps, data.per_item_tokens * steps.rows_per_step,
        evaluate=(lambda: evaluate(engine, model, val)) if val else None, eval_every=steps.eval_every,
        save_every=steps.save_every, watchdog=LossWatchdog(s.loss_watchdog_threshold, s.loss_watchdog_patience),
        early_stopping=EarlyStopping(s.early_stopping_patience),
        before_step=before_step,
    )  # fmt: skip
    record = run_steps(engine, loader, scheduler, plan, WindowLoss(engine))
    base.config.use_cache = True  # training turned it off; generation wants it
    outputs = _write_outputs(engine, tokenizer, None if s.relora else rebuild_whole(job, built))
    summary = _summary(engine, job, record, built, data, steps, warmup, outputs)
    if engine.is_main_process:
        if s.generation_samples and data.validation:
            summary["generations"] = _answers(data.validation[: s.generation_samples], outputs, tokenizer, s)
        curve = [(evaluation["step"], evaluation["eval_loss"]) for evaluation in record.evals]
        _print(summary, Path(cfg.logging.dir), write_summary(engine, summary, record.losses, curve))
    return summary


def _announce(engine: Engine, job: FinetuneJob, built: FinetuneModel, data: Any, model_class: str, steps: int) -> None:
    s, cfg = job.settings, engine.config
    engine.print(
        f"meshkit: fine-tuning {model_class} ({built.parameters / 1e6:.2f}M params, {built.trainable / 1e6:.3f}M "
        f"trainable{adapter_words(s)}) on {engine.num_processes} rank(s), layout "
        f"{engine.mesh.dims.describe()}; {_data_words(s, data, cfg.train.seq_len)}"
        f"{f' packed into {data.row_count} rows' if s.sample_packing and not s.streams else ''}, {steps} steps; "
        f"{where_words(engine)}"
    )
    if data.report.reused:
        engine.print(f"meshkit: reusing tokenized {', '.join(data.report.reused)} from {s.dataset_prepared_path}")
    if data.report.repeated:
        engine.print(f"meshkit: dropped {data.report.repeated} samples that repeat another exactly")
    if data.report.too_long or data.report.nothing_to_train:
        engine.print(
            f"meshkit: dropped {data.report.too_long} samples longer than sequence_len={cfg.train.seq_len} and "
            f"{data.report.nothing_to_train} with no token to train on"
        )


def _data_words(s: Any, data: Any, sequence_len: int) -> str:
    if s.streams:
        what = "pretraining text" if s.pretraining_dataset else "records"
        return f"{what} streamed, each rank its share, packed into rows of {sequence_len} tokens"
    return f"{len(data.train)} train / {len(data.validation)} validation samples"


def _summary(
    engine: Engine,
    job: FinetuneJob,
    record: LoopRecord,
    built: FinetuneModel,
    data: Any,
    steps: StepPlan,
    warmup: int,
    outputs: dict[str, str],
) -> dict[str, Any]:
    """The loop's rows, then the fine-tune's own."""
    s = job.settings
    rows = record.rows(engine, engine.mesh.dims.describe(), lambda value: collectives.gather_object(value, group=None))
    # passes over the data the steps made (a step may read more rows than a small packed dataset holds)
    rows["epochs"] = record.step * steps.rows_per_step / max(1, data.row_count)
    return rows | {
        "adapter": s.adapter,
        "optimizer": s.optimizer,
        "warmup_steps": warmup,
        "parameters": built.parameters,
        "trainable_parameters": built.trainable,
        "samples": {"train": len(data.train), "validation": len(data.validation), "too_long": data.report.too_long},
        "packed_rows": data.row_count if s.sample_packing or s.streams else None,
        "losses": record.losses,
        "evals": record.evals,
        "outputs": outputs,
        "memory": collectives.gather_object(engine.memory_report(), group=None),
    }


def _answers(samples: list[Any], outputs: dict[str, str], tokenizer: Any, s: Any) -> list[dict[str, Any]]:
    """Greedy answers of the exported model to validation prompts, each beside the answer it was trained for."""
    prompts = [prompt_ids(x.input_ids, x.labels, IGNORE_INDEX) for x in samples]
    stop = end_of_turn_ids(tokenizer, s.eot_tokens)
    answers = generate_samples(Path(outputs["merged"]), tokenizer, prompts, s.generation_max_new_tokens, stop)
    for answer, sample in zip(answers, samples, strict=True):
        trained = [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
        answer["expected"] = tokenizer.decode(trained, skip_special_tokens=True)
        answer["right"] = answer["answer"].strip() == answer["expected"].strip()
    return answers


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


def _print(summary: dict[str, Any], run_dir: Path, plot: Path | None) -> None:
    print_summary(summary, run_dir, plot)
    table = Table(title="fine-tune", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("trainable", f"{summary['trainable_parameters']:,} of {summary['parameters']:,}")
    for record in summary["evals"][-1:]:
        table.add_row("eval", f"loss {record['eval_loss']:.4f}, perplexity {record['eval_perplexity']:.2f}")
    for name, path in summary["outputs"].items():
        table.add_row(name, path)
    generations = summary.get("generations", [])
    for sample in generations:
        verdict = "right" if sample["right"] else f"wrong, trained answer {sample['expected'].strip()!r}"
        table.add_row("sample", f"{sample['prompt'][-60:]!r} -> {sample['answer']!r} ({verdict})")
    if generations:
        table.add_row("answers right", f"{sum(g['right'] for g in generations)} of {len(generations)}")
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m meshkit.recipes.finetune CONFIG.yaml [key=value ...]")
    finetune(resolve_finetune(argv[0], argv[1:]))


if __name__ == "__main__":
    main()
