"""The keys of preference and reward training (Axolotl's names, TRL's definitions; null = TRL's default): `rl:`
and each loss's parameters, the reference option, and the reward and process-reward models' heads."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from meshkit.config.section import Section


class PreferenceSettings(Section):
    """What `rl:`, `reward_model` and `process_reward_model` train, and how."""

    rl: Literal["dpo", "ipo", "kto", "orpo", "simpo"] | None = Field(
        None, description="preference training instead of supervised fine-tuning"
    )
    rl_beta: float | None = Field(None, gt=0, description="beta of DPO/IPO/KTO/SimPO; null = 0.1")
    dpo_loss_type: tuple[str, ...] | None = Field(None, description="TRL's DPO loss types, e.g. [sigmoid, sft]")
    dpo_loss_weights: tuple[float, ...] | None = Field(None, description="a weight per dpo_loss_type")
    dpo_label_smoothing: float | None = Field(None, ge=0, lt=1, description="robust / exo_pair / aot smoothing")
    rpo_alpha: float | None = Field(None, ge=0, description="RPO: + alpha × the chosen replies' NLL")
    dpo_use_weighting: bool = Field(
        False, description="WPO: each pair's DPO loss × the policy's weights of its two replies (TRL's use_weighting)"
    )
    orpo_alpha: float | None = Field(None, gt=0, description="ORPO's weight of the odds-ratio term; null = 0.1")
    simpo_gamma: float | None = Field(None, description="SimPO's target reward margin; null = 0.5")
    cpo_alpha: float | None = Field(None, ge=0, description="SimPO/CPO: weight of the chosen replies' NLL; null = 1")
    kto_desirable_weight: float | None = Field(None, gt=0, description="KTO: weight of desirable completions")
    kto_undesirable_weight: float | None = Field(None, gt=0, description="KTO: weight of undesirable completions")
    precompute_ref_log_probs: bool = Field(
        False, description="score the records with the untrained model once before training (no reference model)"
    )
    # reward models
    reward_model: bool = Field(False, description="train a reward model (Bradley-Terry over preference pairs)")
    process_reward_model: bool = Field(
        False, description="train a process reward model: token classification of each step of stepwise_supervised data"
    )
    num_labels: int | None = Field(
        None, ge=1, description="outputs of the head: a reward model's 1, a process reward model's 2 (unset: those)"
    )
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="pull the rewards' mean towards 0 (TRL's center_rewards_coefficient)"
    )

    @field_validator("dpo_loss_type", mode="before")
    @classmethod
    def _one_loss_type_is_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("rl", mode="before")
    @classmethod
    def _offline_rl(cls, value: Any) -> Any:
        if value in ("grpo", "gdpo", "ebft"):
            raise ValueError(
                f"rl: {value} is online RL (the policy generates rollouts that reward functions score, through vLLM), "
                "which meshkit does not run: train offline preference data with dpo, ipo, kto, orpo or simpo"
            )
        return value
