"""Preference losses as pure functions of per-sequence log-probabilities, with TRL's definitions.

Every objective reads one thing from the model: for each sequence of a batch, the summed log-probability of its
completion tokens and how many there are (`SequenceScores`) — from the policy, and for DPO and KTO from the
reference too. That is all any layout has to deliver (summed over context-parallel chunks, gathered from a
vocab-parallel head), so each loss below is layout-free maths, tested against TRL's trainers.

A paired batch holds its chosen rows first, then the rejected rows in the same order (`PairScores.of`). Each
objective returns the mean loss over this rank's examples, the example count (the gradient weight) and metric sums
with their counts, so the metrics of a step are means over every example of every rank (TRL's names).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshkit.core.errors import MeshkitError
from meshkit.training.objective import ObjectiveResult, SequenceScores

DPO_LOSSES = (
    "sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
SMOOTHED_LOSSES = ("robust", "exo_pair", "aot", "aot_unpaired")  # the DPO losses label smoothing enters (TRL)


class PreferenceError(MeshkitError):
    """A preference setting that cannot be honoured; the message says what to change."""


@dataclass(frozen=True)
class PairScores:
    chosen: torch.Tensor  # [pairs] summed completion log-probs
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # [pairs]
    rejected_tokens: torch.Tensor
    whole_chosen: torch.Tensor | None = None  # [pairs] over every real token, prompt included (ORPO's NLL)
    whole_chosen_tokens: torch.Tensor | None = None
    # (chosen tokens, pairs) of the micro-step on every data-parallel rank: the NLL terms are token means over
    # all of them, so that ranks, micro-batches and one process agree; None: this batch's own
    nll_totals: tuple[torch.Tensor, torch.Tensor] | None = None
    weights: torch.Tensor | None = None  # [pairs] WPO's weight of each pair (no graph), when asked for

    @classmethod
    def of(cls, scores: SequenceScores) -> PairScores:
        """A batch of [chosen rows..., rejected rows...]."""
        chosen, rejected = scores.logps.chunk(2)
        chosen_tokens, rejected_tokens = scores.tokens.float().chunk(2)
        whole = whole_tokens = None
        if scores.whole_logps is not None and scores.whole_tokens is not None:
            whole, whole_tokens = scores.whole_logps.chunk(2)[0], scores.whole_tokens.float().chunk(2)[0]
        weights = None
        if scores.log_weights is not None:  # WPO: exp(mean aligned log-prob) of the chosen row × the rejected row's
            chosen_log, rejected_log = scores.log_weights.detach().chunk(2)
            weights = torch.exp(chosen_log) * torch.exp(rejected_log)
        return cls(chosen, rejected, chosen_tokens, rejected_tokens, whole, whole_tokens, weights=weights)

    def select(self, keep: torch.Tensor) -> PairScores:
        """The pairs where `keep` ([pairs] bool) is true (evaluation's filler pairs left out)."""
        whole = None if self.whole_chosen is None else self.whole_chosen[keep]
        whole_tokens = None if self.whole_chosen_tokens is None else self.whole_chosen_tokens[keep]
        weights = None if self.weights is None else self.weights[keep]
        return PairScores(
            self.chosen[keep], self.rejected[keep], self.chosen_tokens[keep], self.rejected_tokens[keep], whole,
            whole_tokens, self.nll_totals, weights,
        )  # fmt: skip

    def with_totals(self, totals: tuple[torch.Tensor, torch.Tensor] | None) -> PairScores:
        return dataclasses.replace(self, nll_totals=totals)

    def mean_per_token(self) -> PairScores:
        """The average log-probability per completion token (SimPO, ORPO, CPO's `average_log_prob`)."""
        chosen = self.chosen / self.chosen_tokens.clamp(min=1)
        return dataclasses.replace(self, chosen=chosen, rejected=self.rejected / self.rejected_tokens.clamp(min=1))

    def chosen_nll(self, whole: bool = False) -> torch.Tensor:
        """The token-mean negative log-likelihood of the chosen completions (the SFT term of RPO and CPO; with
        `whole`, of the whole chosen rows: ORPO's). With `nll_totals` this batch's share of the mean over every
        rank's tokens, scaled by pairs / these pairs: weighted by its pairs, as the other terms are, the shares
        add up to the mean."""
        logps, tokens = (self.whole_chosen, self.whole_chosen_tokens) if whole else (self.chosen, self.chosen_tokens)
        if logps is None or tokens is None:
            raise PreferenceError("this NLL term reads the whole chosen rows: score them with whole_mask")
        if self.nll_totals is None:
            return -logps.sum() / tokens.sum().clamp(min=1)
        token_total, pair_total = self.nll_totals
        return -logps.sum() / token_total.clamp(min=1) * pair_total / max(1, logps.numel())


def _or_one(weights: torch.Tensor | None) -> torch.Tensor | float:
    return 1.0 if weights is None else weights


def _mean_metric(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = values.detach().float()
    return values.sum(), torch.tensor(float(values.numel()), device=values.device)


def _batch_metric(value: torch.Tensor, weight: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A value TRL logs per batch (a token mean): weighted by the batch's examples when summed over ranks."""
    return value.detach().float() * weight, torch.tensor(float(weight), device=value.device)


def _reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        "rewards/chosen": _mean_metric(chosen),
        "rewards/rejected": _mean_metric(rejected),
        "rewards/accuracies": _mean_metric((chosen > rejected).float()),
        "rewards/margins": _mean_metric(chosen - rejected),
    }


@dataclass(frozen=True)
class DPO:
    """TRL's DPOTrainer losses (`loss_type`, combined with `loss_weights`); IPO is `loss_types=("ipo",)`, RPO
    adds `sft` with weight rpo_alpha. Rewards are beta × (policy − reference) log-ratios."""

    beta: float = 0.1
    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    use_weighting: bool = False  # WPO: each pair's loss × the policy's weights of its two rows (TRL's use_weighting)
    uses_reference = True
    paired = True
    needs_whole = False

    def __post_init__(self) -> None:
        unknown = [name for name in self.loss_types if name not in DPO_LOSSES]
        if unknown:
            raise PreferenceError(f"DPO loss type {unknown[0]!r} is not one of {', '.join(DPO_LOSSES)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_types):
            raise PreferenceError(
                f"dpo_loss_weights has {len(self.loss_weights)} weights for {len(self.loss_types)} loss types: "
                "give one weight per loss type"
            )
        if "robust" in self.loss_types and not 0 <= self.label_smoothing < 0.5:
            raise PreferenceError("the robust DPO loss needs dpo_label_smoothing in [0, 0.5)")
        if self.use_weighting and {"aot", "aot_unpaired"} & set(self.loss_types):
            raise PreferenceError(
                "dpo_use_weighting (WPO) does not go with the aot losses, which sort the pairs: drop one of them"
            )
        if "exo_pair" in self.loss_types and self.label_smoothing == 0:
            raise PreferenceError("the exo_pair loss needs dpo_label_smoothing > 0 (the paper suggests 1e-3)")

    def __call__(self, policy: PairScores, reference: PairScores | None = None) -> ObjectiveResult:
        if reference is None:
            raise PreferenceError("DPO's loss reads the reference model's scores: pass them (or use orpo / simpo)")
        chosen_ratio = policy.chosen - reference.chosen
        rejected_ratio = policy.rejected - reference.rejected
        weights = self.loss_weights or (1.0,) * len(self.loss_types)
        pair_weights = policy.weights if self.use_weighting else None
        if self.use_weighting and pair_weights is None:
            raise PreferenceError("WPO weighting needs the policy's weights: score with weighting=True")
        loss = sum(
            (self._per_pair(name, policy, reference, chosen_ratio, rejected_ratio) * _or_one(pair_weights)).mean()
            * weight
            for name, weight in zip(self.loss_types, weights, strict=True)
        )
        assert isinstance(loss, torch.Tensor)
        metrics = _reward_metrics(self.beta * chosen_ratio, self.beta * rejected_ratio)
        metrics["logps/chosen"] = _mean_metric(policy.chosen)
        metrics["logps/rejected"] = _mean_metric(policy.rejected)
        return ObjectiveResult(loss, int(policy.chosen.numel()), metrics)

    def _per_pair(
        self, name: str, policy: PairScores, reference: PairScores, chosen: torch.Tensor, rejected: torch.Tensor
    ) -> torch.Tensor:
        beta, smoothing, delta = self.beta, self.label_smoothing, chosen - rejected
        if name == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if name == "hinge":
            return torch.relu(1 - beta * delta)
        if name in ("ipo", "sigmoid_norm"):  # per-token log-ratios (TRL, as confirmed with IPO's authors)
            per_token = chosen / policy.chosen_tokens.clamp(min=1) - rejected / policy.rejected_tokens.clamp(min=1)
            return (per_token - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * per_token)
        if name == "robust":
            clean, flipped = -(1 - smoothing) * F.logsigmoid(beta * delta), -smoothing * F.logsigmoid(-beta * delta)
            return (clean - flipped) / (1 - 2 * smoothing)
        if name == "exo_pair":
            agree, disagree = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
            return agree * (F.logsigmoid(beta * delta) - math.log1p(-smoothing)) + disagree * (
                F.logsigmoid(-beta * delta) - math.log(smoothing)
            )
        if name == "nca_pair":
            good, bad = beta * chosen, beta * rejected
            return -F.logsigmoid(good) - 0.5 * F.logsigmoid(-good) - 0.5 * F.logsigmoid(-bad)
        if name == "bco_pair":
            return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
        if name == "sppo_hard":
            return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
        if name in ("aot", "aot_unpaired"):
            if name == "aot":
                first = torch.sort(policy.chosen - policy.rejected, dim=0)[0]
                second = torch.sort(reference.chosen - reference.rejected, dim=0)[0]
            else:
                first, second = torch.sort(chosen, dim=0)[0], torch.sort(rejected, dim=0)[0]
            gap = first - second
            return -F.logsigmoid(beta * gap) * (1 - smoothing) - F.logsigmoid(-beta * gap) * smoothing
        if name == "apo_zero":
            return (1 - torch.sigmoid(beta * chosen)) + torch.sigmoid(beta * rejected)
        if name == "apo_down":
            return torch.sigmoid(beta * chosen) + (1 - torch.sigmoid(beta * delta))
        if name == "discopop":
            logits = beta * delta
            mix = torch.sigmoid(logits / self.discopop_tau)
            return -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
        # sft: the chosen completions' token-mean NLL, the same for every pair
        return policy.chosen_nll().expand_as(chosen)


@dataclass(frozen=True)
class KTO:
    """TRL's KTOTrainer: unpaired completions labelled desirable or not; the KL term is the batch's mean
    policy − reference log-ratio on mismatched (prompt, completion) rows, detached, clamped at 0 and averaged over
    every rank (`kl_over` in `__call__`)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"  # or apo_zero_unpaired (no KL term)
    uses_reference = True
    paired = False

    def __post_init__(self) -> None:
        if self.loss_type not in ("kto", "apo_zero_unpaired"):
            raise PreferenceError(f"KTO loss type {self.loss_type!r} is not one of kto, apo_zero_unpaired")

    @property
    def needs_kl(self) -> bool:
        return self.loss_type == "kto"

    def __call__(
        self,
        policy: torch.Tensor,
        reference: torch.Tensor,
        desirable: torch.Tensor,
        kl: torch.Tensor | None,
    ) -> ObjectiveResult:
        """`policy`/`reference`: [rows] summed completion log-probs; `desirable`: [rows] bool; `kl`: the
        batch's KL estimate over every rank (already detached and clamped), or None."""
        ratio = policy - reference
        kl = torch.zeros((), device=policy.device) if kl is None else kl
        good, bad = desirable, ~desirable
        if self.loss_type == "kto":
            chosen_losses = 1 - torch.sigmoid(self.beta * (ratio[good] - kl))
            rejected_losses = 1 - torch.sigmoid(self.beta * (kl - ratio[bad]))
        else:
            chosen_losses = 1 - torch.sigmoid(self.beta * ratio[good])
            rejected_losses = torch.sigmoid(self.beta * ratio[bad])
        losses = torch.cat((self.desirable_weight * chosen_losses, self.undesirable_weight * rejected_losses))
        rewards = self.beta * ratio.detach()
        metrics = {
            "rewards/chosen": _mean_metric(rewards[good]),
            "rewards/rejected": _mean_metric(rewards[bad]),
            "logps/chosen": _mean_metric(policy[good]),
            "logps/rejected": _mean_metric(policy[bad]),
            "kl": _batch_metric(kl, int(policy.numel())),
        }
        return ObjectiveResult(losses.mean(), int(policy.numel()), metrics)


@dataclass(frozen=True)
class ORPO:
    """TRL's ORPOTrainer: the NLL of the chosen rows (prompt included) minus beta × log σ(log-odds ratio) of the
    completions' per-token average log-probs; no reference model. Axolotl's `orpo_alpha` is this beta."""

    needs_whole = True

    beta: float = 0.1
    uses_reference = False
    paired = True

    def __call__(self, policy: PairScores, reference: PairScores | None = None) -> ObjectiveResult:
        nll = policy.chosen_nll(whole=True)  # prompt included (TRL)
        average = policy.mean_per_token()
        chosen, rejected = average.chosen.float(), average.rejected.float()
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        loss = nll - (self.beta * ratio).mean()
        pairs = int(chosen.numel())
        metrics = _reward_metrics(self.beta * chosen.detach(), self.beta * rejected.detach())
        metrics |= {
            "logps/chosen": _mean_metric(chosen),
            "logps/rejected": _mean_metric(rejected),
            "nll_loss": _batch_metric(nll, pairs),
            "log_odds_ratio": _batch_metric(ratio.mean(), pairs),
            "log_odds_chosen": _batch_metric(log_odds.mean(), pairs),
        }
        return ObjectiveResult(loss, pairs, metrics)


@dataclass(frozen=True)
class CPO:
    """TRL's CPOTrainer (`rl: simpo` is `loss_type="simpo"`): no reference model; SimPO and IPO on per-token
    average log-probs with the target margin `simpo_gamma`; plus cpo_alpha × the chosen completions' NLL."""

    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | hinge | ipo | simpo
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    label_smoothing: float = 0.0
    uses_reference = False
    paired = True
    needs_whole = False

    def __post_init__(self) -> None:
        if self.loss_type not in ("sigmoid", "hinge", "ipo", "simpo"):
            raise PreferenceError(f"CPO loss type {self.loss_type!r} is not one of sigmoid, hinge, ipo, simpo")

    def __call__(self, policy: PairScores, reference: PairScores | None = None) -> ObjectiveResult:
        nll = policy.chosen_nll() if self.cpo_alpha else torch.zeros((), device=policy.chosen.device)
        scores = policy.mean_per_token() if self.loss_type in ("ipo", "simpo") else policy
        logits = scores.chosen - scores.rejected
        beta, smoothing = self.beta, self.label_smoothing
        if self.loss_type in ("simpo", "sigmoid"):
            if self.loss_type == "simpo":
                logits = logits - self.simpo_gamma / beta
            losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - beta * logits)
        else:
            losses = (logits - 1 / (2 * beta)) ** 2
        loss = losses.mean() + self.cpo_alpha * nll
        pairs = int(logits.numel())
        metrics = _reward_metrics(beta * scores.chosen.detach(), beta * scores.rejected.detach())
        metrics |= {
            "logps/chosen": _mean_metric(scores.chosen),
            "logps/rejected": _mean_metric(scores.rejected),
            "nll_loss": _batch_metric(nll, pairs),
        }
        return ObjectiveResult(loss, pairs, metrics)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, stable on both sides of −ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass(frozen=True)
class BradleyTerry:
    """TRL's RewardTrainer: −log σ(r_chosen − r_rejected) (minus a margin when the data gives one), plus
    center_rewards_coefficient × the mean squared reward; metrics accuracy, margin and mean_reward."""

    center_rewards_coefficient: float | None = None
    uses_reference = False

    def __call__(
        self, chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
    ) -> ObjectiveResult:  # noqa: E501
        gap = chosen - rejected - (margin if margin is not None else 0.0)
        loss = -F.logsigmoid(gap).mean()
        if self.center_rewards_coefficient is not None:
            loss = loss + self.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
        pairs = int(chosen.numel())
        metrics = {
            "accuracy": _mean_metric((chosen > rejected).float()),
            "margin": _mean_metric(chosen - rejected),
            "mean_reward": _mean_metric(torch.cat((chosen, rejected))),
        }
        return ObjectiveResult(loss, pairs, metrics)
