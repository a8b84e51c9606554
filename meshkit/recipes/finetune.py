"""The fine-tuning recipe: a transformers causal LM on JSONL data, full or LoRA, in any layout.

`meshkit finetune CONFIG.yaml [key=value ...]` runs it (launching itself on `launch.nproc_per_node` ranks);
under a launcher it is `python -m meshkit.recipes.finetune CONFIG.yaml [key=value ...]`. The config takes
Axolotl keys (see `finetune_config`). Outputs in `output_dir`: the LoRA adapter in peft's format at the root,
the merged model (or the fully fine-tuned one) in `merged/`, plus `summary.json`, `metrics.jsonl`, `loss.png`.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from meshkit.config.layout import Layout
from meshkit.config.schema import RunConfig
from meshkit.core.errors import MeshkitError
from meshkit.data.loader import endless
from meshkit.engine.engine import Engine
from meshkit.models.quantized import parameter_count
from meshkit.parallel.materialize import reset_adapters
from meshkit.parallel.pipeline.schedule import forward_only_refusal
from meshkit.recipes.finetune_config import FinetuneJob, resolve_finetune
from meshkit.recipes.hf_base import (
    add_tokens,
    attention_implementation,
    build_meta_model,
    generate_samples,
    grow_vocabulary,
    load_tokenizer,
    prompt_ids,
    replace_directory,
    write_tokenizer,
)
from meshkit.recipes.instruction_data import prepare_data
from meshkit.recipes.lora import apply_lora, continued_weights, save_adapter
from meshkit.recipes.optimizers import build_optimizer, trainable_groups
from meshkit.recipes.optimizers import check_layout as check_optimizer_layout
from meshkit.recipes.quantized_base import INT8_CAST_NOTE, load_quantized_base
from meshkit.recipes.quantized_base import check_layout as check_quantized_layout
from meshkit.recipes.report import TrainingProgress, plot_losses, print_summary
from meshkit.recipes.schedules import build_schedule, warmup_steps
from meshkit.recipes.stopping import EarlyStopping, LossWatchdog
from meshkit.recipes.validation import WindowLoss, eval_batches, evaluate
from meshkit.runtime import collectives
from meshkit.training.loss import IGNORE_INDEX


class FinetuneError(MeshkitError):
    """Fine-tuning settings that cannot train; the message says what to change."""


def check_layout(cfg: RunConfig, dims: Layout, job: FinetuneJob) -> None:
    """What this recipe's data cannot do in the layout `dims`, said before any work (the launcher asks too, for
    every layout the job may have, before any worker starts)."""
    packing, cp, pp, tp = job.settings.sample_packing, dims.cp, dims.pp, dims.tp
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
    if job.settings.peft_use_dora and tp > 1:
        raise FinetuneError(
            "DoRA rescales whole output rows, which tensor parallel splits: set tp=1 or peft_use_dora: false"
        )
    if packing and cfg.train.seq_len % max(1, 2 * cp):
        raise FinetuneError(f"sequence_len={cfg.train.seq_len} must be a multiple of 2 × cp")


def make_optimizer(model: torch.nn.Module, job: FinetuneJob, engine: Engine) -> torch.optim.Optimizer:
    """The trainable parameters (LoRA: the adapters only); no weight decay on biases and norm weights; LoRA+
    gives the B matrices their own learning rate."""
    s, cfg = job.settings, engine.config
    check_optimizer_layout(s.optimizer, engine.zero_stage, engine.mesh.size("tp"))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = trainable_groups((p for _, p in named), cfg.train.weight_decay)
    if s.loraplus_lr_ratio is not None:
        fast = {id(p) for name, p in named if ".lora_B." in name}
        groups = [
            {**group, "params": [p for p in group["params"] if (id(p) in fast) == is_b], **extra}
            for group in groups
            for is_b, extra in ((False, {}), (True, {"lr": cfg.train.lr * s.loraplus_lr_ratio}))
        ]
        groups = [group for group in groups if group["params"]]
    optimizer, notes = build_optimizer(
        s.optimizer,
        groups,
        lr=cfg.train.lr,
        betas=(s.adam_beta1, s.adam_beta2),
        eps=s.adam_epsilon,
        extra=dict(s.optim_args or {}),
    )
    for note in notes:
        engine.print(f"meshkit: {note}")
    return optimizer


def freeze_all_but(model: torch.nn.Module, patterns: tuple[str, ...]) -> None:
    """`unfrozen_parameters`: only parameters whose name matches one of the regexes train."""
    compiled = [re.compile(pattern) for pattern in patterns]
    matched = 0
    for name, param in model.named_parameters():
        param.requires_grad_(any(p.search(name) for p in compiled))
        matched += param.requires_grad
    if not matched:
        raise FinetuneError(f"unfrozen_parameters {list(patterns)} match no parameter of the model: fix the patterns")


def per_epoch(steps_per_epoch: int, times: int | None) -> int | None:
    """Every how many steps something happens `times` per epoch (Axolotl's evals/saves_per_epoch)."""
    return None if times is None else max(1, steps_per_epoch // times)


def finetune(job: FinetuneJob) -> dict[str, Any]:
    """Run the recipe; returns the summary (also written to summary.json on the main process)."""
    with Engine(job.resolved) as engine:
        return _finetune(engine, job)


def _finetune(engine: Engine, job: FinetuneJob) -> dict[str, Any]:
    cfg, s = engine.config, job.settings
    for note in job.notes:
        engine.print(f"meshkit: {note}")
    check_layout(engine.config, engine.mesh.dims, job)
    if s.tf32:
        if engine.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        else:
            engine.print("meshkit: tf32: true has no effect on a CPU (TF32 is a CUDA matmul mode)")
    attention, attention_note = attention_implementation(s.attn_implementation)
    if attention_note:
        engine.print(f"meshkit: {attention_note}")
    check_quantized_layout(s, engine.zero_stage, engine.mesh.size("tp"), engine.mesh.size("pp"), cfg.precision)
    base = load_quantized_base(s, attention, engine.device) if s.quantization else build_meta_model(s, attention)
    if s.quantization == "8bit":
        engine.print(f"meshkit: {INT8_CAST_NOTE}")
    tokenizer = load_tokenizer(s)
    added = add_tokens(tokenizer, s)
    rows = grow_vocabulary(base, len(tokenizer))
    if added:
        grown = f"; the embedding grows from {rows} to {len(tokenizer)} rows, new ones at the mean of the others"
        frozen = " (frozen under LoRA: merged/ holds them)" if s.adapter and not s.lora_modules_to_save else ""
        engine.print(f"meshkit: added tokens {added}{grown if len(tokenizer) > rows else ''}{frozen}")
    data = prepare_data(engine, s, tokenizer)
    if s.unfrozen_parameters and s.adapter is None:
        freeze_all_but(base, s.unfrozen_parameters)
    peft_model = apply_lora(base, s) if s.adapter else None
    model = peft_model.get_base_model() if peft_model is not None else base
    if s.quantization and peft_model is not None:  # built whole: adapters seeded as a meta-built model's are
        reset_adapters(model)
    per_window = cfg.train.global_micro_batch(engine.dp_size)
    steps_per_epoch = max(1, len(data.dataset) // per_window // cfg.grad_accum_steps)
    total_steps = cfg.train.steps if job.steps_given() else max(1, math.ceil(s.num_epochs * steps_per_epoch))
    eval_every = s.eval_steps or per_epoch(steps_per_epoch, s.evals_per_epoch)
    save_every = per_epoch(steps_per_epoch, s.saves_per_epoch)
    n_params = parameter_count(model)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = make_optimizer(model, job, engine)
    warmup = warmup_steps(cfg.train.warmup_steps, s.warmup_ratio, total_steps)
    scheduler = build_schedule(
        s.lr_scheduler,
        optimizer,
        warmup=warmup,
        total=total_steps,
        kwargs=s.lr_scheduler_kwargs,
        min_lr_ratio=s.cosine_min_lr_ratio,
    )
    continued = continued_weights(s.lora_model_dir, model) if s.lora_model_dir and peft_model is not None else None
    model_class = type(base).__name__  # (before prepare: FSDP2 renames a sharded module's class FSDP<name>)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, data.loader, scheduler)
    if continued is not None:  # into this rank's shards; a resumed checkpoint (below) still comes last
        engine.load_full_state_dict(continued)
        engine.print(f"meshkit: continuing the adapter in {s.lora_model_dir} ({len(continued)} tensors)")
    _start_wandb(engine, s)
    tokens_per_step = data.per_item_tokens * per_window * cfg.grad_accum_steps
    engine.print(
        f"meshkit: fine-tuning {model_class} ({n_params / 1e6:.2f}M params, {n_trainable / 1e6:.3f}M "
        f"trainable{_adapter_words(s)}) on {engine.num_processes} rank(s), layout "
        f"{engine.mesh.dims.describe()}; {len(data.train)} train / {len(data.validation)} validation samples"
        f"{f' packed into {len(data.dataset)} rows' if s.sample_packing else ''}, {total_steps} steps"
    )
    if data.report.reused:
        engine.print(f"meshkit: reusing tokenized {', '.join(data.report.reused)} from {s.dataset_prepared_path}")
    if data.report.too_long or data.report.nothing_to_train:
        engine.print(
            f"meshkit: dropped {data.report.too_long} samples longer than sequence_len={cfg.train.seq_len} and "
            f"{data.report.nothing_to_train} with no token to train on"
        )
    val = eval_batches(data.validation, engine, data.collate, s.eval_batch_size)
    resumed = engine.resume()
    engine.checkpoints.arm_preemption()  # save_checkpoint() ends every step: a signal in step 1 checkpoints too
    losses: list[float] = list(resumed.get("losses", [])) if resumed else []
    evals: list[dict[str, float]] = list(resumed.get("evals", [])) if resumed else []
    first_step = len(losses)
    batches = endless(loader)
    window = WindowLoss(engine)
    watchdog, early = (
        LossWatchdog(s.loss_watchdog_threshold, s.loss_watchdog_patience),
        EarlyStopping(s.early_stopping_patience),
    )
    stopped_early = False
    start = time.perf_counter()
    with TrainingProgress(total_steps, enabled=engine.is_main_process) as progress:
        progress.update(first_step, losses[-1] if losses else float("nan"), 0.0)
        while len(losses) < total_steps and not stopped_early:
            batch = next(batches)
            window.add(engine.train_step(batch), batch)
            if not engine.sync_gradients:
                continue
            loss = window.mean()
            losses.append(loss)
            step = len(losses)
            watchdog.check(step, loss)
            tokens_per_s = (step - first_step) * tokens_per_step / (time.perf_counter() - start)
            progress.update(step, loss, tokens_per_s)
            metrics = {"loss": loss, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_per_s}
            if val and eval_every and (step % eval_every == 0 or step == total_steps):
                evals.append({"step": step, **evaluate(engine, model, val)})
                metrics.update(evals[-1])
                stopped_early = early.should_stop(evals[-1]["eval_loss"])
            if step % cfg.train.log_every == 0 or step == total_steps or stopped_early:
                engine.log(metrics, step)
            last = step == total_steps or stopped_early
            due = (last and (cfg.checkpoint.every_steps > 0 or save_every)) or bool(
                save_every and step % save_every == 0
            )
            engine.save_checkpoint(extra={"losses": losses, "evals": evals}, force=due)
    if stopped_early:
        engine.print(
            f"meshkit: early stopping at step {len(losses)}: no better eval loss in {s.early_stopping_patience} "
            f"evaluations (best {early.best:.4f})"
        )
    engine.wait_for_checkpoint()
    wall = time.perf_counter() - start
    trained = len(losses) - first_step
    if val and (not evals or evals[-1]["step"] != len(losses)):
        evals.append({"step": len(losses), **evaluate(engine, model, val)})
    base.config.use_cache = True  # training turned it off; generation wants it
    whole = (lambda: apply_lora(build_meta_model(s, attention), s)) if peft_model else None
    outputs = _write_outputs(engine, tokenizer, whole)
    summary = {
        "final_loss": losses[-1],
        "first_loss": losses[0],
        "steps": len(losses),
        "resumed_at_step": first_step,
        "stopped_early": stopped_early,
        # passes over the data the steps made (a step may read more rows than a small packed dataset holds)
        "epochs": len(losses) * per_window * cfg.grad_accum_steps / max(1, len(data.dataset)),
        "tokens_per_s": trained * tokens_per_step / wall if trained else 0.0,
        "wall_s": wall,
        "world_size": engine.num_processes,
        "layout": engine.mesh.dims.as_dict(),
        "layout_description": engine.mesh.dims.describe(),
        "precision": cfg.precision,
        "zero_stage": engine.zero_stage,
        "adapter": s.adapter,
        "optimizer": s.optimizer,
        "warmup_steps": warmup,
        "parameters": n_params,
        "trainable_parameters": n_trainable,
        "samples": {"train": len(data.train), "validation": len(data.validation), "too_long": data.report.too_long},
        "packed_rows": len(data.dataset) if s.sample_packing else None,
        "losses": losses,
        "evals": evals,
        "outputs": outputs,
        "memory": collectives.gather_object(engine.memory_report(), group=None),
    }
    if engine.is_main_process:
        if s.generation_samples and data.validation:
            summary["generations"] = _answers(data.validation[: s.generation_samples], outputs, tokenizer, s)
        run_dir = Path(cfg.logging.dir)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        curve = [(record["step"], record["eval_loss"]) for record in evals]
        _print(summary, run_dir, plot_losses(losses, run_dir / "loss.png", curve))
    return summary


def _answers(samples: list[Any], outputs: dict[str, str], tokenizer: Any, s: Any) -> list[dict[str, Any]]:
    """Greedy answers of the exported model to validation prompts, each beside the answer it was trained for."""
    prompts = [prompt_ids(x.input_ids, x.labels, IGNORE_INDEX) for x in samples]
    answers = generate_samples(Path(outputs["merged"]), tokenizer, prompts, s.generation_max_new_tokens)
    for answer, sample in zip(answers, samples, strict=True):
        trained = [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
        answer["expected"] = tokenizer.decode(trained, skip_special_tokens=True)
        answer["right"] = answer["answer"].strip() == answer["expected"].strip()
    return answers


def _adapter_words(s: Any) -> str:
    if not s.adapter:
        return ""
    return {"8bit": ", LoRA over an int8 base", "4bit": f", QLoRA over a {s.bnb_4bit_quant_type} base"}.get(
        s.quantization or "", ", LoRA"
    )


def _start_wandb(engine: Engine, s: Any) -> None:
    """The wandb_* keys into the wandb tracker's start (when the tracker runs)."""
    if "wandb" not in engine.config.logging.trackers:
        return
    options = {"entity": s.wandb_entity, "name": s.wandb_name, "id": s.wandb_run_id, "mode": s.wandb_mode}
    engine.init_trackers(s.wandb_project or "meshkit", init_kwargs={"wandb": {k: v for k, v in options.items() if v}})


def _write_outputs(engine: Engine, tokenizer: Any, lora_model: Any) -> dict[str, str]:
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
