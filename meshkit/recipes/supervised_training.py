"""Supervised fine-tuning as a `TrainingKind`: instruction, chat, completion or pretraining text (prepared, packed or
streamed), the causal-LM loss over the trained tokens, evaluation's loss and perplexity, and greedy answers of the
exported model to validation prompts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshkit.data.formats import end_of_turn_ids
from meshkit.engine.engine import Engine
from meshkit.recipes import schemes
from meshkit.recipes.finetune_config import FinetuneJob
from meshkit.recipes.finetune_setup import FinetuneModel
from meshkit.recipes.hf_base import generate_samples, prompt_ids
from meshkit.recipes.instruction_data import prepare_data
from meshkit.recipes.loop import LoopRecord, StepLoss
from meshkit.recipes.streaming_data import prepare_stream
from meshkit.recipes.validation import WindowLoss, eval_batches, evaluate
from meshkit.training.loss import IGNORE_INDEX


class SupervisedTraining:
    """The causal-LM loss over the tokens the data trains (`train_on_inputs`, roles, masks)."""

    name = "sft"

    def __init__(self, job: FinetuneJob) -> None:
        self.settings = job.settings
        self.data: Any = None
        self.tokenizer: Any = None

    def load_data(self, engine: Engine, tokenizer: Any) -> None:
        s, self.tokenizer = self.settings, tokenizer
        streams = s.streams
        self.data = (
            prepare_stream(engine, s, tokenizer, engine.config.train.steps)
            if streams
            else prepare_data(engine, s, tokenizer)
        )

    @property
    def rows(self) -> int:
        return int(self.data.row_count)

    @property
    def loader(self) -> Any:
        return self.data.loader

    @property
    def tokens_per_row(self) -> float:
        return float(self.data.per_item_tokens)

    def token_ids(self) -> Iterable[Sequence[int]]:
        return (sample.input_ids for sample in self.data.train)

    def before_prepare(self, engine: Engine, built: FinetuneModel) -> None:
        pass

    def after_prepare(self, engine: Engine, model: nn.Module, built: FinetuneModel) -> None:
        schemes.weigh_tokens(engine, self.settings)

    def banner(self, engine: Engine) -> tuple[str, str, list[str]]:
        s, data, sequence_len = self.settings, self.data, engine.config.train.seq_len
        if s.streams:
            what = "pretraining text" if s.pretraining_dataset else "records"
            words = f"{what} streamed, each rank its share, packed into rows of {sequence_len} tokens"
        else:
            words = f"{len(data.train)} train / {len(data.validation)} validation samples"
            words += f" packed into {data.row_count} rows" if s.sample_packing else ""
        notes = []
        if data.report.reused:
            notes.append(f"reusing tokenized {', '.join(data.report.reused)} from {s.dataset_prepared_path}")
        if data.report.repeated:
            notes.append(f"dropped {data.report.repeated} samples that repeat another exactly")
        if data.report.too_long or data.report.nothing_to_train:
            notes.append(
                f"dropped {data.report.too_long} samples longer than sequence_len={sequence_len} and "
                f"{data.report.nothing_to_train} with no token to train on"
            )
        return "fine-tuning", words, notes

    def objective_words(self) -> str:
        weighted = " weighted by EAFT's entropy" if self.settings.use_eaft else ""
        return f"causal-LM cross-entropy{weighted}, the mean over every trained token of a step"

    def step_loss(self, engine: Engine) -> StepLoss:
        return WindowLoss(engine)

    def micro_step(self) -> Callable[[Any], torch.Tensor] | None:
        return None  # (engine.train_step: the model's causal-LM loss)

    def evaluation(self, engine: Engine, model: nn.Module) -> Callable[[], dict[str, float]] | None:
        batches = eval_batches(self.data.validation, engine, self.data.collate, self.settings.eval_batch_size)
        return (lambda: evaluate(engine, model, batches)) if batches else None

    def summary_rows(self, engine: Engine, record: LoopRecord, outputs: dict[str, str]) -> dict[str, Any]:
        s, data = self.settings, self.data
        rows: dict[str, Any] = {
            "samples": {"train": len(data.train), "validation": len(data.validation), "too_long": data.report.too_long},
            "packed_rows": data.row_count if s.sample_packing or s.streams else None,
        }
        if engine.is_main_process and s.generation_samples and data.validation:
            rows["generations"] = self._answers(data.validation[: s.generation_samples], outputs)
        return rows

    def _answers(self, samples: list[Any], outputs: dict[str, str]) -> list[dict[str, Any]]:
        """Greedy answers of the exported model to validation prompts, each beside the answer it was trained for."""
        s, tokenizer = self.settings, self.tokenizer
        prompts = [prompt_ids(x.input_ids, x.labels, IGNORE_INDEX) for x in samples]
        stop = end_of_turn_ids(tokenizer, s.eot_tokens)
        answers = generate_samples(Path(outputs["merged"]), tokenizer, prompts, s.generation_max_new_tokens, stop)
        for answer, sample in zip(answers, samples, strict=True):
            trained = [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
            answer["expected"] = tokenizer.decode(trained, skip_special_tokens=True)
            answer["right"] = answer["answer"].strip() == answer["expected"].strip()
        return answers

    def plot_curves(
        self, record: LoopRecord
    ) -> tuple[list[tuple[float, float]], dict[str, list[tuple[float, float]]] | None]:
        return [(evaluation["step"], evaluation["eval_loss"]) for evaluation in record.evals], None

    def table_rows(self, summary: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
        rows = [
            ("eval", f"loss {record['eval_loss']:.4f}, perplexity {record['eval_perplexity']:.2f}")
            for record in summary["evals"][-1:]
        ]
        generations = summary.get("generations", [])
        for sample in generations:
            verdict = "right" if sample["right"] else f"wrong, trained answer {sample['expected'].strip()!r}"
            rows.append(("sample", f"{sample['prompt'][-60:]!r} -> {sample['answer']!r} ({verdict})"))
        if generations:
            rows.append(("answers right", f"{sum(g['right'] for g in generations)} of {len(generations)}"))
        return "fine-tune", rows
