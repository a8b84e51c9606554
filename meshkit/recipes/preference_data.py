"""The preference fine-tune's data in the run's layout: records tokenized as TRL does, this rank's batches, and the
reference log-probabilities scored once before training (`precompute_reference`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from meshkit.data.preference_tokens import (
    PreferenceCollate,
    PreferenceReport,
    RewardCollate,
    load_preference_records,
    with_kl_completions,
)
from meshkit.data.selection import shard, without_repeats
from meshkit.data.sources import cpu_share
from meshkit.data.stepwise import StepCollate, StepwiseReport, load_stepwise_records
from meshkit.engine.engine import Engine
from meshkit.recipes.instruction_data import InstructionDataError, held_out
from meshkit.runtime import collectives


class PreferenceRows(Dataset):
    """The tokenized records (an Arrow table), one dict of columns per record; the reference columns join the
    table once scored."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.table[index])


@dataclass
class PreferenceData:
    rows: PreferenceRows
    report: PreferenceReport | StepwiseReport
    collate: PreferenceCollate | RewardCollate | StepCollate
    loader: DataLoader
    paired: bool
    validation: Any = None  # the held-out records (an Arrow table), or None

    @property
    def per_item_tokens(self) -> float:
        """Tokens one record puts through the model (both rows of a pair)."""
        table = self.rows.table
        if "input_ids" in table.column_names:  # a process reward model's rows
            return sum(len(ids) for ids in table["input_ids"]) / max(1, len(table))
        prompts = sum(len(ids) for ids in table["prompt_ids"]) if "prompt_ids" in table.column_names else 0
        replies = ("chosen_ids", "rejected_ids") if self.paired else ("completion_ids",)
        total = sum(len(ids) for name in replies for ids in table[name]) + prompts * len(replies)
        return total / max(1, len(table))


BOS_FIRST_METHODS = ("orpo", "simpo")  # TRL's ORPOTrainer and CPOTrainer put BOS before the prompt


def prepare_preference_data(
    engine: Engine, settings: Any, tokenizer: Any, paired: bool, reward: bool = False
) -> PreferenceData:
    """Pairs (or KTO's completions, or a reward model's pairs when `reward`; a process reward model's step-labelled
    rows under `process_reward_model`) in this rank's batches."""
    cfg = engine.config
    if settings.process_reward_model:
        return _stepwise_data(engine, settings, tokenizer)
    with engine.main_process_first(per_node=True):
        table, report = load_preference_records(
            settings.datasets,
            tokenizer,
            paired=paired,
            sequence_len=cfg.train.seq_len,
            num_proc=settings.dataset_processes or cpu_share(engine.info.local_world_size),
            keep_in_memory=settings.dataset_keep_in_memory,
            reward=reward,
            template_kwargs=settings.chat_template_kwargs,
            seed=cfg.seed,
            bos_first=settings.rl in BOS_FIRST_METHODS,
        )
    table = _selected(table, settings, report)
    validation = None
    if settings.test_datasets:
        with engine.main_process_first(per_node=True):
            validation = load_preference_records(
                settings.test_datasets,
                tokenizer,
                paired=paired,
                sequence_len=cfg.train.seq_len,
                reward=reward,
                seed=cfg.seed,
                bos_first=settings.rl in BOS_FIRST_METHODS,
            )[0]
    elif settings.val_set_size:
        table, validation = _held_out(table, settings.val_set_size, cfg.seed)
    per_window = cfg.train.global_micro_batch(engine.dp_size)
    if len(table) < per_window:
        raise InstructionDataError(
            f"{len(table)} preference records are fewer than one global micro-batch ({per_window}): lower "
            f"micro_batch_size, or add data ({report.prompt_too_long} prompts filled sequence_len={cfg.train.seq_len})"
        )
    if not paired:  # KTO's KL rows: completions rotated within each global micro-batch of records
        table = with_kl_completions(table, per_window)
        if validation is not None and len(validation):
            validation = with_kl_completions(validation, per_window)
    multiple_of, fixed = _widths(engine)
    collate: PreferenceCollate | RewardCollate = (
        RewardCollate(tokenizer.pad_token_id, multiple_of, fixed)
        if reward
        else PreferenceCollate(tokenizer.pad_token_id, cfg.train.seq_len, paired, multiple_of, fixed)
    )
    rows = PreferenceRows(table)
    return PreferenceData(rows, report, collate, _loader(rows, collate, settings, cfg), paired, validation)


def _stepwise_data(engine: Engine, settings: Any, tokenizer: Any) -> PreferenceData:
    cfg = engine.config

    def load(entries: Any) -> tuple[Any, StepwiseReport]:
        with engine.main_process_first(per_node=True):
            return load_stepwise_records(
                entries,
                tokenizer,
                sequence_len=cfg.train.seq_len,
                keep_in_memory=settings.dataset_keep_in_memory,
                seed=cfg.seed,
            )

    table, report = load(settings.datasets)
    table = _selected(table, settings, report)
    validation = load(settings.test_datasets)[0] if settings.test_datasets else None
    if validation is None and settings.val_set_size:
        table, validation = _held_out(table, settings.val_set_size, cfg.seed)
    per_window = cfg.train.global_micro_batch(engine.dp_size)
    if len(table) < per_window:
        raise InstructionDataError(
            f"{len(table)} stepwise records are fewer than one global micro-batch ({per_window}): lower "
            "micro_batch_size, or add data"
        )
    collate, rows = StepCollate(tokenizer.pad_token_id, *_widths(engine)), PreferenceRows(table)
    return PreferenceData(rows, report, collate, _loader(rows, collate, settings, cfg), False, validation)


def _widths(engine: Engine) -> tuple[int, int | None]:
    """(what a batch's width is a multiple of, its fixed width): 2 × cp under context parallel (each rank takes two
    equal chunks), sequence_len under pipeline parallel (the stages take fixed shapes)."""
    cp = engine.mesh.size("cp")
    return 2 * cp if cp > 1 else 1, engine.config.train.seq_len if engine.mesh.size("pp") > 1 else None


def _selected(table: Any, settings: Any, report: Any) -> Any:
    """The records that train: the shard asked for (dataset_shard_num/idx), without exact repeats when asked
    (counted in `report.repeated`)."""
    table = shard(table, settings.dataset_shard_num, settings.dataset_shard_idx)
    if settings.dataset_exact_deduplication:
        table, report.repeated = without_repeats(table, table.column_names)
    return table


def _loader(rows: PreferenceRows, collate: Any, settings: Any, cfg: Any) -> DataLoader:
    """This rank's batches: shuffled, or in the records' order under curriculum_sampling."""
    return DataLoader(
        rows,
        batch_size=cfg.train.largest_micro_batch,
        shuffle=not settings.curriculum_sampling,
        drop_last=True,
        collate_fn=collate,
    )


def _held_out(table: Any, size: float, seed: int) -> tuple[Any, Any]:
    """(train, validation) of the records (`held_out`)."""
    train, held = held_out(len(table), size, seed, "records")
    return table.select(train), table.select(held)


def eval_batches(engine: Engine, data: PreferenceData, size: int | None) -> list[dict[str, Any]]:
    """This rank's validation batches: every record once over the data-parallel ranks; ranks with fewer records
    fill up with copies marked `valid: false` (counted nowhere), so every rank runs as many forwards."""
    table = data.validation
    if table is None or not len(table):
        return []
    size, dp = size or engine.config.train.largest_micro_batch, engine.dp_size
    mine = list(range(engine.dp_rank, len(table), dp))
    batches = math.ceil(math.ceil(len(table) / dp) / size)
    filler = batches * size - len(mine)
    indices = mine + [0] * filler
    out = []
    for number in range(batches):
        chunk = indices[number * size : (number + 1) * size]
        batch = data.collate([dict(table[i]) for i in chunk])
        valid = [position < len(mine) for position in range(number * size, (number + 1) * size)]
        batch["valid"] = torch.tensor(valid)
        out.append(batch)
    return out


def precompute_reference(engine: Engine, model: torch.nn.Module, data: PreferenceData) -> None:
    """Score every record (training and held out) with the untrained model (eval mode, no graph) once, in the
    run's layout: each data-parallel rank scores its share, the scores are gathered, and every rank's tables gain
    the columns the objective reads instead of a reference model."""
    model.eval()
    data.rows.table = _with_reference_columns(engine, data, data.rows.table)
    if data.validation is not None and len(data.validation):
        data.validation = _with_reference_columns(engine, data, data.validation)
    model.train()


def _with_reference_columns(engine: Engine, data: PreferenceData, table: Any) -> Any:
    from meshkit.engine.objective_step import LayoutScorer

    size, dp, rank = engine.config.train.largest_micro_batch, engine.dp_size, engine.dp_rank
    mine = list(range(rank, len(table), dp))
    rounds = math.ceil(math.ceil(len(table) / dp) / size)  # batches per rank: every rank runs as many forwards
    score = LayoutScorer(engine.ctx, forward_only=True)
    found: dict[int, list[float]] = {}
    for number in range(rounds):
        chunk = mine[number * size : (number + 1) * size] or mine[-1:] or [0]
        chunk = chunk + chunk[-1:] * (size - len(chunk))  # (a full batch: repeats are scored twice, kept once)
        batch = data.collate([dict(table[i]) for i in chunk])
        main = score(batch["input_ids"], batch["labels"]).logps.double().cpu()
        extra = None
        if "kl_input_ids" in batch:
            extra = score(batch["kl_input_ids"], batch["kl_labels"]).logps.double().cpu()
        for position, index in enumerate(chunk):
            if data.paired:
                found[index] = [float(main[position]), float(main[position + len(chunk)])]
            else:
                found[index] = [float(main[position]), float(extra[position]) if extra is not None else 0.0]
    merged: dict[int, list[float]] = {}
    for part in collectives.gather_object(found, group=engine.mesh.dp_group):
        merged.update(part)
    names = ("reference_chosen", "reference_rejected") if data.paired else ("reference_logps", "reference_kl_logps")
    for column, name in enumerate(names):
        table = table.add_column(name, [merged[i][column] for i in range(len(table))])
    return table
