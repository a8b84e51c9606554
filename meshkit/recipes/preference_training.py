"""Preference and reward training as a `TrainingKind`: `rl:` (dpo, ipo, kto, orpo, simpo), `reward_model: true`
and `process_reward_model: true`. The data are pairs, KTO's labelled completions or step-labelled rows; the
objective is the preference loss against a reference (`meshkit.recipes.preference`), Bradley–Terry over a
classification head's scores (`reward`) or token classification of each step (`process_reward`); the summary
reports TRL's metrics."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from meshkit.data.stepwise import StepwiseReport
from meshkit.engine.engine import Engine
from meshkit.recipes.finetune_config import FinetuneJob
from meshkit.recipes.finetune_setup import FinetuneModel
from meshkit.recipes.hf_base import weights_file
from meshkit.recipes.loop import LoopRecord, StepLoss
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
from meshkit.recipes.preference_data import PreferenceData, eval_batches, precompute_reference, prepare_preference_data
from meshkit.recipes.process_reward import StepObjective
from meshkit.recipes.reward import RewardObjective
from meshkit.training.preference import BradleyTerry
from meshkit.tuning.untrained_tokens import fix_untrained_tokens

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
ID_COLUMNS = ("input_ids", "prompt_ids", "chosen_ids", "rejected_ids", "completion_ids")


class PreferenceTraining:
    """The DPO family, KTO, a reward model or a process reward model, as the settings choose."""

    def __init__(self, job: FinetuneJob) -> None:
        s = self.settings = job.settings
        self.name: str = s.rl or ("process_reward_model" if s.process_reward_model else "reward_model")
        self.loss: Any = (
            StepObjective()
            if s.process_reward_model
            else BradleyTerry(s.center_rewards_coefficient)
            if s.reward_model
            else preference_loss(s)
        )
        self.paired = not isinstance(self.loss, (KTO, StepObjective))
        self.data: PreferenceData | None = None
        self.twin: nn.Module | None = None
        self.reference: Reference | None = None
        self.objective: Any = None
        self.window: PreferenceWindow | None = None
        self.pad_token_id: int | None = None

    @property
    def _data(self) -> PreferenceData:
        assert self.data is not None, "load_data comes first"
        return self.data

    def load_data(self, engine: Engine, tokenizer: Any) -> None:
        self.pad_token_id = tokenizer.pad_token_id
        s = self.settings
        self.data = prepare_preference_data(engine, s, tokenizer, self.paired, reward=s.reward_model)

    @property
    def rows(self) -> int:
        return len(self._data.rows)

    @property
    def loader(self) -> Any:
        return self._data.loader

    @property
    def tokens_per_row(self) -> float:
        return self._data.per_item_tokens

    def token_ids(self) -> Iterable[Sequence[int]]:
        table = self._data.rows.table
        for name in ID_COLUMNS:
            if name in table.column_names:
                yield from table[name]

    def before_prepare(self, engine: Engine, built: FinetuneModel) -> None:
        """A full fine-tune's reference: a frozen copy of the untrained model (still on the meta device when the
        weights stream in: the copy streams its own), laid out like the policy. Under pipeline parallel (no frozen
        pipeline yet) the records are scored once before training instead (the same numbers)."""
        s = self.settings
        keeps_copy = built.peft_model is None and not s.precompute_ref_log_probs and engine.mesh.size("pp") == 1
        if self.loss.uses_reference and keeps_copy:
            self.twin = copy.deepcopy(built.model)

    def after_prepare(self, engine: Engine, model: nn.Module, built: FinetuneModel) -> None:
        """The reference (the frozen copy laid out, the base with adapters off, or the records scored once) and the
        objective over it."""
        s, loss = self.settings, self.loss
        if self.twin is not None:
            frozen = engine.prepare_frozen(self.twin)
            if s.fix_untrained_tokens:  # (the policy's rows were fixed: the untrained model is the fixed one)
                fix_untrained_tokens(frozen, s.fix_untrained_tokens, weights_file(s.base_model), self.token_ids())
            self.reference = Reference(model=frozen)
        elif loss.uses_reference and built.peft_model is not None and not s.precompute_ref_log_probs:
            self.reference = Reference(context=adapters_off(built.peft_model))  # LoRA: the base is the reference
        elif loss.uses_reference:
            precompute_reference(engine, model, self._data)  # scored once, untrained: no reference model kept
            self.reference = Reference(precomputed=True)
        if s.process_reward_model:
            self.objective = loss
        elif s.reward_model:
            self.objective = RewardObjective(loss, self.pad_token_id)  # (pooled where the model pools)
        elif self.paired:
            self.objective = PairedObjective(loss, self.reference, engine)
        else:
            self.objective = UnpairedObjective(cast(KTO, loss), self.reference, engine)  # (unpaired: KTO's loss)
        self.window = PreferenceWindow(engine, self.objective)

    def banner(self, engine: Engine) -> tuple[str, str, list[str]]:
        s, data = self.settings, self._data
        method = s.rl or ("process reward model" if s.process_reward_model else "reward model")
        unit = "pairs" if self.paired else "step-labelled rows" if s.process_reward_model else "completions"
        reference = self.reference.describe() if self.reference else "none"
        notes = []
        if data.report.repeated:
            notes.append(f"dropped {data.report.repeated} records that repeat another exactly")
        if isinstance(data.report, StepwiseReport):
            if data.report.truncated:
                notes.append(f"cut {data.report.truncated} rows longer than sequence_len to it (as Axolotl does)")
        elif s.reward_model and data.report.prompt_too_long:
            notes.append(f"dropped {data.report.prompt_too_long} pairs longer than sequence_len (as TRL does)")
        elif data.report.prompt_too_long or data.report.truncated:
            notes.append(
                f"dropped {data.report.prompt_too_long} records whose prompt fills sequence_len="
                f"{engine.config.train.seq_len}; cut {data.report.truncated} longer rows to it (TRL's keep_start)"
            )
        return f"{method} on", f"{len(data.rows)} {unit}; reference: {reference}", notes

    def objective_words(self) -> str:
        loss = type(self.loss).__name__
        reference = f" against {self.reference.describe()}" if self.reference else ""
        return f"{loss}{reference}"

    def step_loss(self, engine: Engine) -> StepLoss:
        assert self.window is not None, "after_prepare comes first"
        return self.window

    def micro_step(self) -> Callable[[Any], torch.Tensor] | None:
        assert self.window is not None, "after_prepare comes first"
        return self.window.step  # (`Engine.objective_step` over the objective)

    def evaluation(self, engine: Engine, model: nn.Module) -> Callable[[], dict[str, float]] | None:
        batches = eval_batches(engine, self._data, self.settings.eval_batch_size)
        return (lambda: evaluate_preference(engine, model, self.objective, batches)) if batches else None

    def summary_rows(self, engine: Engine, record: LoopRecord, outputs: dict[str, str]) -> dict[str, Any]:
        data = self._data
        return {
            "rl": self.name,
            "reference": self.reference.describe() if self.reference else None,
            "records": len(data.rows),
            "validation_records": len(data.validation) if data.validation is not None else 0,
            "dropped_long_prompts": getattr(data.report, "prompt_too_long", 0),
            "metrics": record.metrics,
            "final_metrics": record.metrics[-1] if record.metrics else {},
        }

    def _accuracy_name(self) -> str:
        return "accuracy" if self.settings.reward_model or self.settings.process_reward_model else "rewards/accuracies"

    def _accuracy_curve(self, metrics: list[dict[str, float]]) -> list[tuple[float, float]]:
        name = self._accuracy_name()
        return [(step + 1, m[name]) for step, m in enumerate(metrics) if name in m]

    def plot_curves(
        self, record: LoopRecord
    ) -> tuple[list[tuple[float, float]], dict[str, list[tuple[float, float]]] | None]:
        curve = self._accuracy_curve(record.metrics)
        evals = [(e["step"], e["eval_loss"]) for e in record.evals]
        return evals, {self._accuracy_name(): curve} if curve else None

    def table_rows(self, summary: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
        rows = [("reference", str(summary["reference"]))]
        final = summary["final_metrics"]
        rows += [(name, f"{final[name]:.4f}") for name in SHOWN if name in final]
        curve = self._accuracy_curve(summary["metrics"])
        if curve:
            picks = sorted({round(i * (len(curve) - 1) / 7) for i in range(8)})  # 8 steps from first to last
            rows.append(("accuracy at step", "  ".join(f"{curve[i][0]:.0f}: {curve[i][1]:.2f}" for i in picks)))
        for evaluation in summary["evals"][-1:]:
            shown = [f"loss {evaluation['eval_loss']:.4f}"]
            names = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_accuracy", "eval_margin")
            shown += [f"{name[5:]} {evaluation[name]:.4f}" for name in names if name in evaluation]
            rows.append(("eval", ", ".join(shown)))
        return f"preference training ({summary['rl']})", rows
