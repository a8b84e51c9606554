"""`meshkit finetune` with `rl:` (dpo, ipo, kto, orpo, simpo): the fine-tune's set-up, the preference data and
objective, the shared loop, and the same outputs (adapter, merged model, summary with TRL's metrics)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from rich.console import Console
from rich.table import Table

from meshkit.data.stepwise import StepwiseReport
from meshkit.engine.engine import Engine
from meshkit.engine.where_it_runs import where_words
from meshkit.recipes.finetune_config import FinetuneJob
from meshkit.recipes.finetune_setup import (
    adapt,
    adapter_words,
    make_optimizer,
    make_schedule,
    rebuild_whole,
    start_adapters,
    step_plan,
)
from meshkit.recipes.loop import LoopPlan, run_steps, write_summary
from meshkit.recipes.preference import (
    KTO,
    PairedObjective,
    PreferenceWindow,
    Reference,
    UnpairedObjective,
    adapters_off,
    evaluate_preference,
    preference_loss,
)
from meshkit.recipes.preference_data import eval_batches, precompute_reference, prepare_preference_data
from meshkit.recipes.process_reward import StepObjective
from meshkit.recipes.report import print_summary
from meshkit.recipes.reward import RewardObjective
from meshkit.runtime import collectives
from meshkit.training.preference import BradleyTerry
from meshkit.training.stopping import EarlyStopping, LossWatchdog
from meshkit.tuning.qat import fake_quant_switch

SHOWN = (
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "kl",
    "accuracy",
    "margin",
    "mean_reward",
)


def train_preference(
    engine: Engine, job: FinetuneJob, base: Any, tokenizer: Any, attention: Any, write_outputs: Callable[..., dict]
) -> dict[str, Any]:
    cfg, s = engine.config, job.settings
    loss: Any
    if s.process_reward_model:
        loss = StepObjective()
    else:
        loss = BradleyTerry(s.center_rewards_coefficient) if s.reward_model else preference_loss(s)
    paired = not isinstance(loss, (KTO, StepObjective))
    data = prepare_preference_data(engine, s, tokenizer, paired, reward=s.reward_model)
    built = adapt(job, base, tokenizer, attention)
    for note in built.notes:
        engine.print(f"meshkit: {note}")
    steps = step_plan(engine, job, len(data.rows))
    optimizer = make_optimizer(built.model, job, engine)
    scheduler, warmup = make_schedule(engine, job, optimizer, steps.total_steps)
    model_class = type(base).__name__
    # a full fine-tune's reference: a frozen copy of the untrained model (still on the meta device when the
    # weights stream in: the copy streams its own), laid out like the policy
    uses_reference = loss.uses_reference
    twin = copy.deepcopy(built.model) if _keeps_a_copy(uses_reference, built, s, engine.mesh.size("pp")) else None
    model, optimizer, loader, scheduler = engine.prepare(built.model, optimizer, data.loader, scheduler)
    start_adapters(engine, job, built)  # (before the reference is scored)
    reference = None
    if twin is not None:
        reference = Reference(model=engine.prepare_frozen(twin))
    elif uses_reference and built.peft_model is not None and not s.precompute_ref_log_probs:
        reference = Reference(context=adapters_off(built.peft_model))  # LoRA: the base is the reference
    elif uses_reference:
        precompute_reference(engine, model, data)  # scored once, untrained: no reference model kept
        reference = Reference(precomputed=True)
    objective: Any
    if s.process_reward_model:
        objective = loss
    elif s.reward_model:
        objective = RewardObjective(loss, tokenizer.pad_token_id)  # (pooled where the model pools)
    elif paired:
        objective = PairedObjective(loss, reference, engine)
    else:
        objective = UnpairedObjective(cast(KTO, loss), reference, engine)  # (unpaired data: the loss is KTO's)
    method = s.rl or ("process reward model" if s.process_reward_model else "reward model")
    engine.print(
        f"meshkit: {method} on {model_class} ({built.parameters / 1e6:.2f}M params, {built.trainable / 1e6:.3f}M "
        f"trainable{adapter_words(s)}) on {engine.num_processes} rank(s), layout {engine.mesh.dims.describe()}; "
        f"{len(data.rows)} {'pairs' if paired else 'step-labelled rows' if s.process_reward_model else 'completions'}"
        f", {steps.total_steps} steps; reference: "
        f"{reference.describe() if reference else 'none'}; {where_words(engine)}"
    )
    if data.report.repeated:
        engine.print(f"meshkit: dropped {data.report.repeated} records that repeat another exactly")
    if isinstance(data.report, StepwiseReport):
        if data.report.truncated:
            engine.print(f"meshkit: cut {data.report.truncated} rows longer than sequence_len to it (as Axolotl does)")
    elif s.reward_model and data.report.prompt_too_long:
        engine.print(f"meshkit: dropped {data.report.prompt_too_long} pairs longer than sequence_len (as TRL does)")
    elif data.report.prompt_too_long or data.report.truncated:
        engine.print(
            f"meshkit: dropped {data.report.prompt_too_long} records whose prompt fills sequence_len="
            f"{cfg.train.seq_len}; cut {data.report.truncated} longer rows to it (TRL's keep_start)"
        )
    window = PreferenceWindow(engine, objective)
    validation = eval_batches(engine, data, s.eval_batch_size)
    plan = LoopPlan(
        steps.total_steps, data.per_item_tokens * steps.rows_per_step,
        evaluate=(lambda: evaluate_preference(engine, model, objective, validation)) if validation else None,
        eval_every=steps.eval_every, save_every=steps.save_every,
        watchdog=LossWatchdog(s.loss_watchdog_threshold, s.loss_watchdog_patience),
        early_stopping=EarlyStopping(s.early_stopping_patience), step=window.step,
        before_step=fake_quant_switch(model, s.qat) if s.qat is not None else None,
    )  # fmt: skip
    record = run_steps(engine, loader, scheduler, plan, window)
    base.config.use_cache = True
    outputs = write_outputs(engine, tokenizer, rebuild_whole(job, built))
    rows = record.rows(engine, engine.mesh.dims.describe(), lambda value: collectives.gather_object(value, group=None))
    summary = rows | {
        "rl": s.rl or ("process_reward_model" if s.process_reward_model else "reward_model"),
        "reference": reference.describe() if reference else None,
        "adapter": s.adapter,
        "optimizer": s.optimizer,
        "warmup_steps": warmup,
        "parameters": built.parameters,
        "trainable_parameters": built.trainable,
        "records": len(data.rows),
        "validation_records": len(data.validation) if data.validation is not None else 0,
        "evals": record.evals,
        "dropped_long_prompts": getattr(data.report, "prompt_too_long", 0),
        "losses": record.losses,
        "metrics": record.metrics,
        "final_metrics": record.metrics[-1] if record.metrics else {},
        "outputs": outputs,
        "memory": collectives.gather_object(engine.memory_report(), group=None),
    }
    if engine.is_main_process:
        accuracy = "accuracy" if s.reward_model or s.process_reward_model else "rewards/accuracies"
        curve: list[tuple[float, float]] = [
            (step + 1, m[accuracy]) for step, m in enumerate(record.metrics) if accuracy in m
        ]
        evals = [(e["step"], e["eval_loss"]) for e in record.evals]
        plot = write_summary(engine, summary, record.losses, evals, {accuracy: curve} if curve else None)
        print_summary(summary, Path(cfg.logging.dir), plot)
        _print(summary, curve)
    return summary


def _keeps_a_copy(uses_reference: bool, built: Any, settings: Any, pp: int) -> bool:
    """A full fine-tune keeps a frozen copy as its reference, but under pipeline parallel (no frozen pipeline
    yet) it scores the records once before training instead (the same numbers)."""
    return uses_reference and built.peft_model is None and not settings.precompute_ref_log_probs and pp == 1


def _print(summary: dict[str, Any], curve: list[tuple[float, float]]) -> None:
    table = Table(title=f"preference training ({summary['rl']})", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("reference", str(summary["reference"]))
    table.add_row("trainable", f"{summary['trainable_parameters']:,} of {summary['parameters']:,}")
    final = summary["final_metrics"]
    for name in SHOWN:
        if name in final:
            table.add_row(name, f"{final[name]:.4f}")
    if curve:
        picks = sorted({round(i * (len(curve) - 1) / 7) for i in range(8)})  # 8 steps from first to last
        table.add_row("accuracy at step", "  ".join(f"{curve[i][0]:.0f}: {curve[i][1]:.2f}" for i in picks))
    for evaluation in summary["evals"][-1:]:
        shown = [f"loss {evaluation['eval_loss']:.4f}"]
        shown += [
            f"{name[5:]} {evaluation[name]:.4f}"
            for name in ("eval_rewards/accuracies", "eval_rewards/margins", "eval_accuracy", "eval_margin")
            if name in evaluation
        ]  # noqa: E501
        table.add_row("eval", ", ".join(shown))
    for name, path in summary["outputs"].items():
        table.add_row(name, path)
    Console().print(table)
