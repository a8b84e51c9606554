"""The fine-tuning recipe: a transformers causal LM on JSONL data, full or LoRA, in any layout.

`meshkit finetune CONFIG.yaml [key=value ...]` runs it (launching itself on `launch.nproc_per_node` ranks);
under a launcher it is `python -m meshkit.recipes.finetune CONFIG.yaml [key=value ...]`. The config takes
Axolotl keys (see `finetune_config`). Outputs in `output_dir`: the LoRA adapter in peft's format at the root,
the merged model (or the fully fine-tuned one) in `merged/`, plus `summary.json`, `metrics.jsonl`, `loss.png`.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from meshkit import collectives
from meshkit.data.formats import TokenizedSample, load_samples
from meshkit.data.loader import endless
from meshkit.data.packing import PackedSamples, PadCollate, PaddedSamples
from meshkit.engine import Engine
from meshkit.errors import MeshkitError
from meshkit.loss import IGNORE_INDEX
from meshkit.recipes.finetune_config import FinetuneJob, resolve_finetune
from meshkit.recipes.hf_base import (
    build_meta_model,
    generate_samples,
    load_tokenizer,
    prompt_ids,
    replace_directory,
    write_tokenizer,
)
from meshkit.recipes.lora import apply_lora, save_adapter
from meshkit.recipes.report import TrainingProgress, plot_losses, print_summary
from meshkit.tree import to_device


class FinetuneError(MeshkitError):
    """Fine-tuning settings that cannot train; the message says what to change."""


def split_validation(
    samples: list[TokenizedSample], size: float, seed: int
) -> tuple[list[TokenizedSample], list[TokenizedSample]]:
    """(train, validation): `size` < 1 is a share, >= 1 a count; chosen by a seeded shuffle."""
    count = int(size) if size >= 1 else int(round(size * len(samples)))
    if count == 0:
        return samples, []
    if count >= len(samples):
        raise FinetuneError(f"val_set_size={size} leaves no training samples out of {len(samples)}: lower it")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return [s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)]


def check_layout(engine: Engine, job: FinetuneJob) -> None:
    """What this recipe's data cannot do in the chosen layout, said before any work."""
    cfg, packing = engine.config, job.settings.sample_packing
    cp, pp = engine.mesh.size("cp"), engine.mesh.size("pp")
    if cfg.strategy != "auto":  # its evaluation, exports and generations meet every rank in collectives
        raise FinetuneError(
            f"meshkit finetune runs the layouts of strategy=auto (DDP, ZeRO, tp, pp, cp), not strategy={cfg.strategy}: "
            "drop strategy, or drive that strategy from your own script with meshkit.Engine"
        )
    if packing and pp > 1:
        raise FinetuneError(
            "sample_packing passes position_ids, which a pipeline stage does not take: set pp=1 or "
            "sample_packing: false"
        )
    if packing and cp > 1:
        raise FinetuneError(
            "sample_packing keeps samples apart by position_ids, which ring attention does not: "
            "set cp=1 or sample_packing: false"
        )
    if packing and cfg.train.seq_len % max(1, 2 * cp):
        raise FinetuneError(f"sequence_len={cfg.train.seq_len} must be a multiple of 2 × cp")


def make_optimizer(model: torch.nn.Module, job: FinetuneJob, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The trainable parameters (LoRA: the adapters only); no weight decay on biases and norm weights."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    s = job.settings
    if s.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_epsilon)


def lr_schedule(job: FinetuneJob, optimizer: torch.optim.Optimizer, warmup: int, total: int) -> Any:
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[job.settings.lr_scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def eval_batches(samples: list[TokenizedSample], engine: Engine, collate: Any) -> list[dict[str, torch.Tensor]]:
    """This rank's validation batches: every sample exactly once over the data-parallel ranks; ranks with fewer
    samples fill up with rows whose labels are all -100 (they count nothing), so every rank runs as many
    batches of the same size (pipelines and sharded parameters need all ranks in each forward)."""
    if not samples:
        return []
    size, dp = engine.config.train.largest_micro_batch, engine.dp_size
    per_rank = -(-len(samples) // dp)
    batches = -(-per_rank // size)
    mine = samples[engine.dp_rank :: dp]
    filler = TokenizedSample(samples[0].input_ids, (IGNORE_INDEX,) * len(samples[0].labels))
    mine = mine + [filler] * (batches * size - len(mine))
    dataset = PaddedSamples(mine)
    return [collate([dataset[i] for i in range(b * size, (b + 1) * size)]) for b in range(batches)]


def evaluate(engine: Engine, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    total, count = 0.0, 0
    model.eval()
    for batch in batches:
        loss_sum, tokens = engine.eval_token_loss(to_device(batch, engine.device))
        total, count = total + loss_sum, count + tokens
    model.train()
    loss = total / max(count, 1)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": count}


class WindowLoss:
    """The loss of an optimizer step: the mean over every counted token of its micro-steps on every
    data-parallel rank (each micro-step's loss, from `train_step`, is its own token mean)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.losses: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        self.losses.append(loss.detach().float())
        self.tokens.append((batch["labels"][:, 1:] != IGNORE_INDEX).sum().float())  # next-token targets

    def mean(self) -> float:
        # every cp rank holds the whole batch: count over the data-parallel ranks only
        tokens = collectives.reduce(torch.stack(self.tokens), self.engine.mesh.dp_group, op="sum")
        loss = float((torch.stack(self.losses) * tokens).sum() / tokens.sum().clamp(min=1))
        self.losses, self.tokens = [], []
        return loss


def finetune(job: FinetuneJob) -> dict[str, Any]:
    """Run the recipe; returns the summary (also written to summary.json on the main process)."""
    with Engine(job.resolved) as engine:
        return _finetune(engine, job)


def _finetune(engine: Engine, job: FinetuneJob) -> dict[str, Any]:
    cfg, s = engine.config, job.settings
    for note in job.notes:
        engine.print(f"meshkit: {note}")
    check_layout(engine, job)
    tokenizer = load_tokenizer(s)
    datasets = [(entry.path, entry.type) for entry in s.datasets]
    samples, report = load_samples(
        datasets, tokenizer, sequence_len=cfg.train.seq_len, train_on_inputs=s.train_on_inputs
    )
    train_samples, val_samples = split_validation(samples, s.val_set_size, cfg.seed)
    cp = engine.mesh.size("cp")
    fixed = cfg.train.seq_len if engine.mesh.size("pp") > 1 else None
    collate = PadCollate(tokenizer.pad_token_id, multiple_of=2 * cp if cp > 1 else 1, width=fixed)
    dataset: PackedSamples | PaddedSamples = (
        PackedSamples(train_samples, cfg.train.seq_len, tokenizer.pad_token_id)
        if s.sample_packing
        else PaddedSamples(train_samples)
    )
    per_window = cfg.train.global_micro_batch(engine.dp_size)
    if len(dataset) < per_window:
        raise FinetuneError(
            f"{len(dataset)} training {'rows' if s.sample_packing else 'samples'} are fewer than one global "
            f"micro-batch ({per_window}): lower micro_batch_size, or add data ({report.too_long} samples were "
            f"longer than sequence_len={cfg.train.seq_len})"
        )
    loader = DataLoader(
        dataset,
        batch_size=cfg.train.largest_micro_batch,
        shuffle=True,
        drop_last=True,
        collate_fn=None if s.sample_packing else collate,
    )
    base = build_meta_model(s)
    peft_model = apply_lora(base, s) if s.adapter == "lora" else None
    model = peft_model.get_base_model() if peft_model is not None else base
    batches_per_epoch = len(dataset) // per_window
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum_steps)
    total_steps = cfg.train.steps if job.steps_given() else max(1, math.ceil(s.num_epochs * steps_per_epoch))
    model_name = type(base).__name__
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = make_optimizer(model, job, cfg.train.lr, cfg.train.weight_decay)
    scheduler = lr_schedule(job, optimizer, cfg.train.warmup_steps, total_steps)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    tokens_per_item = dataset.real_tokens / len(dataset)
    tokens_per_step = tokens_per_item * per_window * cfg.grad_accum_steps
    engine.print(
        f"meshkit: fine-tuning {model_name} ({n_params / 1e6:.2f}M params, {n_trainable / 1e6:.3f}M "
        f"trainable{', LoRA' if peft_model else ''}) on {engine.num_processes} rank(s), layout "
        f"{engine.mesh.dims.describe()}; {len(train_samples)} train / {len(val_samples)} validation samples"
        f"{f' packed into {len(dataset)} rows' if s.sample_packing else ''}, {total_steps} steps"
    )
    if report.too_long or report.nothing_to_train:
        engine.print(
            f"meshkit: dropped {report.too_long} samples longer than sequence_len={cfg.train.seq_len} and "
            f"{report.nothing_to_train} with no token to train on"
        )
    val = eval_batches(val_samples, engine, collate)
    resumed = engine.resume()
    losses: list[float] = list(resumed.get("losses", [])) if resumed else []
    evals: list[dict[str, float]] = list(resumed.get("evals", [])) if resumed else []
    first_step = len(losses)
    batches = endless(loader)
    window = WindowLoss(engine)
    start = time.perf_counter()
    with TrainingProgress(total_steps, enabled=engine.is_main_process) as progress:
        progress.update(first_step, losses[-1] if losses else float("nan"), 0.0)
        while len(losses) < total_steps:
            batch = next(batches)
            window.add(engine.train_step(batch), batch)
            if not engine.sync_gradients:
                continue
            loss = window.mean()
            losses.append(loss)
            step = len(losses)
            tokens_per_s = (step - first_step) * tokens_per_step / (time.perf_counter() - start)
            progress.update(step, loss, tokens_per_s)
            metrics = {"loss": loss, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_per_s}
            if val and s.eval_steps and (step % s.eval_steps == 0 or step == total_steps):
                evals.append({"step": step, **evaluate(engine, model, val)})
                metrics.update(evals[-1])
            if step % cfg.train.log_every == 0 or step == total_steps:
                engine.log(metrics, step)
            final = step == total_steps and cfg.checkpoint.every_steps > 0
            engine.save_checkpoint(extra={"losses": losses, "evals": evals}, force=final)
    engine.wait_for_checkpoint()
    wall = time.perf_counter() - start
    trained = len(losses) - first_step
    if val and (not evals or evals[-1]["step"] != len(losses)):
        evals.append({"step": len(losses), **evaluate(engine, model, val)})
    base.config.use_cache = True  # training turned it off; generation wants it
    outputs = _write_outputs(engine, tokenizer, (lambda: apply_lora(build_meta_model(s), s)) if peft_model else None)
    summary = {
        "final_loss": losses[-1],
        "first_loss": losses[0],
        "steps": len(losses),
        "resumed_at_step": first_step,
        "epochs": len(losses) / steps_per_epoch,
        "tokens_per_s": trained * tokens_per_step / wall if trained else 0.0,
        "wall_s": wall,
        "world_size": engine.num_processes,
        "layout": engine.mesh.dims.as_dict(),
        "layout_description": engine.mesh.dims.describe(),
        "precision": cfg.precision,
        "zero_stage": engine.zero_stage,
        "adapter": s.adapter,
        "parameters": n_params,
        "trainable_parameters": n_trainable,
        "samples": {"train": len(train_samples), "validation": len(val_samples), "too_long": report.too_long},
        "packed_rows": len(dataset) if s.sample_packing else None,
        "losses": losses,
        "evals": evals,
        "outputs": outputs,
        "memory": collectives.gather_object(engine.memory_report(), group=None),
    }
    if engine.is_main_process:
        if s.generation_samples and val_samples:
            prompts = [prompt_ids(x.input_ids, x.labels, IGNORE_INDEX) for x in val_samples[: s.generation_samples]]
            summary["generations"] = generate_samples(
                Path(outputs["merged"]), tokenizer, prompts, s.generation_max_new_tokens
            )
        run_dir = Path(cfg.logging.dir)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _print(summary, run_dir, plot_losses(losses, run_dir / "loss.png"))
    return summary


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
    for sample in summary.get("generations", []):
        table.add_row("sample", f"{sample['prompt'][-60:]!r} -> {sample['answer']!r}")
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m meshkit.recipes.finetune CONFIG.yaml [key=value ...]")
    finetune(resolve_finetune(argv[0], argv[1:]))


if __name__ == "__main__":
    main()
