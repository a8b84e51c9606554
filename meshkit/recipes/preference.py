"""Preference training in the fine-tune recipe: the objective Axolotl's `rl:` keys select, the reference model,
and the step loss that reports TRL's metrics.

The reference model, cheapest first:
- `precompute_ref_log_probs: true`: one pass of the untrained policy over the training records before the first
  step; each record keeps its reference log-probabilities (no second model, no second forward per step);
- LoRA / QLoRA: the policy with its adapters off (peft's `disable_adapter`): the base is the reference;
- a full fine-tune: a frozen copy of the base, laid out like the policy (sharded alike under ZeRO-3 and tp).
ORPO and SimPO need no reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshkit.engine.engine import Engine
from meshkit.models.adapters import adapters_disabled
from meshkit.runtime import collectives
from meshkit.training.loss import IGNORE_INDEX
from meshkit.training.objective import ObjectiveResult, Scorer, SequenceScores
from meshkit.training.preference import CPO, DPO, KTO, ORPO, PairScores, PreferenceError

PairedLoss = DPO | ORPO | CPO


def preference_loss(settings: Any) -> PairedLoss | KTO:
    """The loss `rl:` and its keys select, with TRL's defaults where a key is unset."""
    rl, beta = settings.rl, settings.rl_beta
    if rl in ("dpo", "ipo"):
        types = ("ipo",) if rl == "ipo" else tuple(settings.dpo_loss_type or ("sigmoid",))
        weights = tuple(settings.dpo_loss_weights) if settings.dpo_loss_weights else None
        if settings.rpo_alpha is not None:  # RPO: DPO plus the chosen completions' NLL (TRL: loss type sft)
            weights = (*(weights or (1.0,) * len(types)), settings.rpo_alpha)
            types = (*types, "sft")
        return DPO(
            beta=0.1 if beta is None else beta,
            loss_types=types,
            loss_weights=weights,
            label_smoothing=settings.dpo_label_smoothing or 0.0,
            use_weighting=settings.dpo_use_weighting,
        )
    if rl == "kto":
        return KTO(
            beta=0.1 if beta is None else beta,
            desirable_weight=settings.kto_desirable_weight or 1.0,
            undesirable_weight=settings.kto_undesirable_weight or 1.0,
        )
    if rl == "orpo":  # TRL's ORPO calls it beta; Axolotl passes orpo_alpha there
        return ORPO(beta=settings.orpo_alpha if settings.orpo_alpha is not None else 0.1 if beta is None else beta)
    if rl == "simpo":
        return CPO(
            beta=0.1 if beta is None else beta,
            loss_type="simpo",
            simpo_gamma=0.5 if settings.simpo_gamma is None else settings.simpo_gamma,
            cpo_alpha=1.0 if settings.cpo_alpha is None else settings.cpo_alpha,
        )
    raise PreferenceError(f"rl: {rl} is not a preference method meshkit trains (dpo, ipo, kto, orpo, simpo)")


@dataclass(frozen=True)
class Reference:
    """How reference log-probabilities are had: from the batch (precomputed), or by scoring with `model` (a
    frozen copy) or inside `context` (adapters off)."""

    model: nn.Module | None = None
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    precomputed: bool = False

    def scores(self, score: Scorer, input_ids: torch.Tensor, labels: torch.Tensor, stored: Any) -> torch.Tensor:
        if self.precomputed:
            return stored.float()
        return score(input_ids, labels, model=self.model, context=self.context, grad=False).logps

    def describe(self) -> str:
        if self.precomputed:
            return "precomputed reference log-probs (no reference model kept)"
        return "the base with adapters off" if self.context is not None else "a frozen copy laid out like the policy"


def adapters_off(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The adapted layers of `model` run their base weights only (the structure layer's switch)."""
    return lambda: adapters_disabled(model)


class PairedObjective:
    """DPO, IPO, ORPO and SimPO over a paired batch: chosen and rejected rows run in one forward.

    In two phases, so a pipeline can run the second on its last stage: `references` scores what needs no graph
    (the reference) into per-row tensors; `loss_of` turns the policy's scores of those rows into the result."""

    def __init__(self, loss: PairedLoss, reference: Reference | None, engine: Engine | None = None) -> None:
        self.loss, self.reference, self.engine = loss, reference, engine
        self.needs_whole = loss.needs_whole
        self.needs_weighting = getattr(loss, "use_weighting", False)  # WPO
        self.pairs_together = True  # a micro-batch holds both rows of each of its pairs
        self.reads_head = False

    def references(self, score: Scorer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = batch["input_ids"].shape[0]
        valid = batch["valid"] if "valid" in batch else torch.ones(rows // 2, dtype=torch.bool)
        extras = {"valid": valid.repeat(2)}
        if self.engine is not None:  # the NLL terms' denominators: every rank's chosen tokens and pairs
            counted = batch["attention_mask"] if self.needs_whole else batch["labels"] != IGNORE_INDEX
            tokens = counted[: rows // 2, 1:].sum(-1).float()  # (next-token targets of the chosen rows)
            kept = valid.to(tokens.device)
            local = torch.stack((tokens[kept].sum(), kept.sum().float())).to(self.engine.device)
            total = collectives.reduce(local, self.engine.mesh.dp_group, op="sum").cpu()
            extras["nll_tokens"], extras["nll_pairs"] = total[0].expand(rows), total[1].expand(rows)
        if self.loss.uses_reference:
            assert self.reference is not None
            stored = batch.get("reference_logps")
            extras["reference"] = self.reference.scores(score, batch["input_ids"], batch["labels"], stored)
        return extras

    def loss_of(self, policy_rows: SequenceScores, extras: dict[str, torch.Tensor]) -> ObjectiveResult:
        policy = PairScores.of(policy_rows)
        device = policy.chosen.device
        keep = extras["valid"].to(device).chunk(2)[0]  # an evaluation batch's filler pairs count nothing
        if "nll_tokens" in extras:
            policy = policy.with_totals((extras["nll_tokens"][0].to(device), extras["nll_pairs"][0].to(device)))
        if "reference" not in extras:
            return self.loss(policy.select(keep))
        chosen, rejected = extras["reference"].to(device).float().chunk(2)
        reference = PairScores(chosen, rejected, policy.chosen_tokens, policy.rejected_tokens)
        return self.loss(policy.select(keep), reference.select(keep))

    def __call__(self, score: Scorer, batch: dict[str, torch.Tensor]) -> ObjectiveResult:
        extras = self.references(score, batch)
        whole = batch["attention_mask"] if self.needs_whole else None
        scores = score(batch["input_ids"], batch["labels"], whole_mask=whole, weighting=self.needs_weighting)
        return self.loss_of(scores, extras)


class UnpairedObjective:
    """KTO: desirable and undesirable completions; the KL term from the batch's mismatched rows, its mean over
    every data-parallel rank. Two phases, as `PairedObjective`."""

    def __init__(self, loss: KTO, reference: Reference | None, engine: Engine) -> None:
        if reference is None:
            raise PreferenceError("KTO scores against a reference model: the recipe gives it one")
        self.loss, self.reference, self.engine = loss, reference, engine
        self.needs_whole = False
        self.needs_weighting = False
        self.pairs_together = False
        self.reads_head = False

    def references(self, score: Scorer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        input_ids, labels = batch["input_ids"], batch["labels"]
        rows = input_ids.shape[0]
        keep = batch["valid"] if "valid" in batch else torch.ones(rows, dtype=torch.bool)
        extras = {"valid": keep, "desirable": batch["desirable"]}
        extras["reference"] = self.reference.scores(score, input_ids, labels, batch.get("reference_logps")).float()
        if self.loss.needs_kl:
            kl_ids, kl_labels = batch["kl_input_ids"], batch["kl_labels"]
            policy_kl = score(kl_ids, kl_labels, grad=False).logps
            reference_kl = self.reference.scores(score, kl_ids, kl_labels, batch.get("reference_kl_logps"))
            gap = policy_kl - reference_kl.to(policy_kl.device)
            kept = keep.to(gap.device)  # the mean over every rank's real rows
            sums = torch.stack((gap[kept].sum(), kept.sum().float()))
            total = collectives.reduce(sums, self.engine.mesh.dp_group, op="sum")
            extras["kl"] = (total[0] / total[1].clamp(min=1)).clamp(min=0).expand(rows)
        return extras

    def loss_of(self, policy_rows: SequenceScores, extras: dict[str, torch.Tensor]) -> ObjectiveResult:
        policy = policy_rows.logps
        kept = extras["valid"].to(policy.device)
        reference = extras["reference"].to(policy.device)[kept]
        desirable = extras["desirable"].to(policy.device)[kept]
        kl = extras["kl"].to(policy.device)[0] if "kl" in extras and len(extras["kl"]) else None
        return self.loss(policy[kept], reference, desirable, kl)

    def __call__(self, score: Scorer, batch: dict[str, torch.Tensor]) -> ObjectiveResult:
        extras = self.references(score, batch)
        return self.loss_of(score(batch["input_ids"], batch["labels"]), extras)


class PreferenceWindow:
    """The step loss of preference training: runs `Engine.objective_step`, and gives the step's loss (mean over
    every example of its micro-steps on every rank) and TRL's metrics over the same examples."""

    def __init__(self, engine: Engine, objective: PairedObjective | UnpairedObjective) -> None:
        self.engine, self.objective = engine, objective
        self.sums: dict[str, list[torch.Tensor]] = {}
        self.reduced: dict[str, float] = {}  # the last step's metrics (`mean` reduces them)

    def step(self, batch: Any) -> torch.Tensor:
        result = self.engine.objective_step(batch, self.objective)
        items = torch.tensor(float(result.items))
        self.add_sums("loss", result.loss.detach().float().cpu() * items, items)  # (already a mean over every rank)
        for name, (total, count) in result.metrics.items():
            self.add_sums(name, total.detach().float().cpu(), count.detach().float().cpu())
        return result.loss

    def add_sums(self, name: str, total: torch.Tensor, count: torch.Tensor) -> None:
        pair = self.sums.setdefault(name, [torch.zeros(()), torch.zeros(())])
        pair[0] += total
        pair[1] += count

    def add(self, loss: torch.Tensor, batch: Any) -> None:
        pass  # (`step` keeps the sums)

    def mean(self) -> float:
        self.reduced = self._reduce()
        return self.reduced.pop("loss")

    def metrics(self) -> dict[str, float]:
        return self.reduced

    def _reduce(self) -> dict[str, float]:
        """Metric sums and counts over the data-parallel ranks (the loss is already every rank's mean)."""
        names = sorted(self.sums)
        loss_total, loss_count = self.sums.pop("loss")
        names.remove("loss")
        stacked = torch.stack([torch.stack(self.sums[name]) for name in names]) if names else torch.zeros((0, 2))
        summed = collectives.reduce(stacked.to(self.engine.device), self.engine.mesh.dp_group, op="sum").cpu()
        out = {"loss": float(loss_total / loss_count.clamp(min=1))}
        for index, name in enumerate(names):
            total, count = summed[index]
            if count > 0:
                out[name] = float(total / count)
        if "rewards/chosen" in out and "rewards/rejected" in out and "rewards/margins" not in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]  # (KTO: as TRL logs it)
        self.sums = {}
        return out


def evaluate_preference(
    engine: Engine, model: nn.Module, objective: PairedObjective | UnpairedObjective, batches: list[dict[str, Any]]
) -> dict[str, float]:
    """The objective's loss and metrics over the validation records (eval mode, no graph), as TRL's `eval_*`."""
    from meshkit.engine.objective_step import LayoutScorer

    forward_only = LayoutScorer(engine.ctx, forward_only=True)
    window = PreferenceWindow(engine, objective)
    model.eval()
    with torch.no_grad():
        for batch in batches:
            result = objective(forward_only, batch)
            mean = result.loss.detach().float().cpu() if result.items else torch.zeros(())  # (a rank of fillers)
            total = collectives.reduce(
                torch.stack((mean * result.items, torch.tensor(float(result.items)))).to(engine.device),
                engine.mesh.dp_group,
                op="sum",
            ).cpu()  # (the loss over every rank's records, as the training steps report it)
            window.add_sums("loss", total[0], total[1])
            for name, (value, count) in result.metrics.items():
                window.add_sums(name, value.detach().float().cpu(), count.detach().float().cpu())
    model.train()
    loss = window.mean()
    return {"eval_loss": loss, **{f"eval_{name}": value for name, value in window.metrics().items()}}
