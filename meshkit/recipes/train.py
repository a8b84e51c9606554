"""The built-in recipe: train the reference GPT on a text with the standard loop.

`meshkit train CONFIG.yaml [key=value ...]` runs it (launching itself on `launch.nproc_per_node` ranks);
under a launcher it is `python -m meshkit.recipes.train CONFIG.yaml [key=value ...]`. The main process shows
a progress bar and writes `<logging.dir>/summary.json`, `metrics.jsonl` and `loss.png`.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from meshkit.config.resolve import ResolvedConfig, launch_flags_from_env, parse_assignments, resolve
from meshkit.core.errors import MeshkitError
from meshkit.core.io import state_dict_sha256
from meshkit.data.loader import endless
from meshkit.data.text import BYTE_VOCAB_SIZE, ByteTokenizer, TokenWindows, load_text
from meshkit.engine.engine import Engine
from meshkit.engine.layout_auto import optimizer_step
from meshkit.engine.where_it_runs import where_words
from meshkit.launching.cluster import cluster_settings
from meshkit.models.gpt import GPT, lm_loss
from meshkit.recipes.loop import LoopPlan, MeanStepLoss, run_steps, write_summary
from meshkit.recipes.report import print_summary
from meshkit.runtime import collectives


class RecipeError(MeshkitError):
    """Recipe settings that cannot train (model too small for the tokens, too little text, ...)."""


def resolve_recipe(
    config_file: str | os.PathLike[str] | None, assignments: list[str], *, cluster: bool = False
) -> ResolvedConfig:
    """File < environment < launch flags (the launcher's, then `key=value` arguments); `cluster`: this process
    launches, so a scheduler's variables (SLURM, PyTorchJob) count too."""
    flags, labels = launch_flags_from_env(os.environ)
    from_args = parse_assignments(assignments)
    flags.update(from_args)
    labels.update({key: f"argument {key}" for key in from_args})
    scheduler = cluster_settings(os.environ) if cluster else None
    return resolve(flags=flags, flag_labels=labels, file=config_file, cluster=scheduler)


def warmup_cosine(warmup: int, total: int) -> Any:
    """LR multiplier: linear warm-up to 1, then cosine decay to 10 %."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(resolved: ResolvedConfig) -> dict[str, Any]:
    """Run the recipe; returns the summary (also written to summary.json on the main process). Under `layout: auto`
    the Engine's `prepare` tries the planner's top layouts on the recipe's objects, then trains in the fastest."""
    with Engine(resolved) as engine:
        return _train(engine)


def probe_step(engine: Engine) -> Any:
    """A layout probe's step (`meshkit plan --probe`): the recipe's objects on `engine`, one optimizer step per
    call."""
    _model, _optimizer, loader, _scheduler = _prepared(engine)
    return optimizer_step(engine, endless(loader))


def _prepared(engine: Engine) -> tuple[Any, Any, Any, Any]:
    """The GPT, AdamW, the text's loader and the warm-up/cosine schedule, prepared on `engine`."""
    cfg = engine.config
    if cfg.model.vocab_size < BYTE_VOCAB_SIZE:
        raise RecipeError(f"model.vocab_size={cfg.model.vocab_size} is too small for byte tokens: use 256 or more")
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise RecipeError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    dataset = TokenWindows(ByteTokenizer().encode(load_text(cfg.train.dataset)), cfg.train.seq_len)
    per_window = cfg.train.global_micro_batch(engine.dp_size)
    if len(dataset) < per_window:
        raise RecipeError(
            f"the text gives {len(dataset)} sequences of {cfg.train.seq_len} tokens, fewer than one global "
            f"micro-batch ({per_window}): lower train.micro_batch_size or train.seq_len, or use a longer text"
        )
    loader = DataLoader(dataset, batch_size=cfg.train.largest_micro_batch, shuffle=True, drop_last=True)
    model = GPT(cfg.model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=cfg.train.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.train.warmup_steps, cfg.train.steps))
    return engine.prepare(model, optimizer, loader, scheduler, loss_fn=lm_loss)


def _train(engine: Engine) -> dict[str, Any]:
    _model, _optimizer, loader, scheduler = _prepared(engine)
    cfg = engine.config  # (after prepare: under layout: auto, the chosen layout's)
    if not engine.is_worker:
        return {}  # a parameter server: its prepare() served until every worker had finished
    n_params = sum(p.numel() for p in engine.unwrap_model().parameters())
    layout = engine.placement.describe()
    tokens_per_step = cfg.train.global_micro_batch(engine.dp_size) * cfg.train.seq_len * cfg.grad_accum_steps
    if engine.is_main_worker:
        print(
            f"meshkit: training GPT ({n_params / 1e6:.2f}M params) on {engine.num_processes} rank(s), "
            f"layout {layout}, precision {cfg.precision}, {tokens_per_step} tokens/step; {where_words(engine)}",
            flush=True,
        )
    plan = LoopPlan(cfg.train.steps, tokens_per_step, measure_activations=True)
    # (ranks that never meet, e.g. asynchronous parameter-server workers, each report their own loss)
    shared_loss = engine.placement.steps_together
    record = run_steps(engine, loader, scheduler, plan, MeanStepLoss(engine, cfg.grad_accum_steps, shared_loss))

    def every_rank(value: Any) -> list[Any]:  # in rank order (where a rank may be lost, this rank's own)
        return collectives.gather_object(value, group=None) if engine.placement.every_rank_meets else [value]

    memory = every_rank({**engine.memory_report(), "rank": engine.process_index})  # before the full state below
    summary = record.rows(engine, layout, every_rank) | {
        "grad_accum_steps": cfg.grad_accum_steps,
        "parameters": n_params,
        "params_sha256": state_dict_sha256(engine.full_state_dict()),
        "memory": memory,
        "activation_checkpointing": cfg.activation_checkpointing.model_dump(),
        "activation_offload": cfg.activation_offload,
        "activations": every_rank(record.activations),  # first micro-step, per rank
    }
    if engine.layout_probe is not None:
        summary["layout_probe"] = {"chosen": layout, "candidates": [c.row() for c in engine.layout_probe]}
    if engine.is_main_worker:
        plot = write_summary(engine, summary, record.losses)
        print_summary(summary, Path(cfg.logging.dir), plot)
    return summary


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m meshkit.recipes.train CONFIG.yaml [key=value ...]")
    train(resolve_recipe(argv[0], argv[1:]))


if __name__ == "__main__":
    main()
