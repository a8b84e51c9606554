"""The fine-tune's training schemes besides plain steps, under their Axolotl names: LISA (layers sampled to train,
`meshkit.recipes.lisa`), ReLoRA (adapters merged into the base and restarted, `meshkit.recipes.relora`), the
jagged learning-rate restarts that go with it (`meshkit.recipes.schedules`) and EAFT's entropy-weighted token loss
(`meshkit.training.token_weights`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from meshkit.config.schema import Section

PruneMethod = Literal["magnitude", "random", "reset"]
FULL_RESET_RATIO = 0.999  # 'reset': nearly every optimizer state value zeroed (ReLoRA's paper)


class SchemeSettings(Section):
    """LISA, ReLoRA and jagged restarts (Axolotl's keys)."""

    lisa_n_layers: int | None = Field(None, ge=1, description="LISA: blocks trained at a time (the rest frozen)")
    lisa_step_interval: int | None = Field(None, ge=1, description="LISA: every how many steps new blocks are drawn")
    lisa_layers_attribute: str | None = Field(
        None, description="LISA: the block list's path (e.g. model.layers); null = the model's blocks"
    )
    relora: bool = Field(False, description="ReLoRA: adapters merged into the base and restarted every restart step")
    relora_prune_ratio: float | None = Field(
        None, ge=0, le=1, description="share of the adapters' optimizer state zeroed at a restart (0.9; reset 0.999)"
    )
    relora_prune_method: PruneMethod | None = Field(
        None, description="magnitude (the smallest zeroed; default) | random | reset"
    )
    use_eaft: bool = Field(False, description="EAFT: each token's loss weighted by its top-k entropy ** alpha")
    eaft_alpha: float = Field(1.0, ge=0, description="EAFT: the entropy's exponent")
    eaft_k: int = Field(20, ge=1, description="EAFT: the top logits the entropy is taken over")
    jagged_restart_steps: int | None = Field(None, ge=1, description="every how many steps the lr restarts")
    jagged_restart_warmup_steps: int | None = Field(None, ge=1, description="warm-up steps after a restart (10)")
    jagged_restart_anneal_steps: int | None = Field(None, ge=1, description="steps annealed before a restart (1)")

    @field_validator("jagged_restart_warmup_steps", "jagged_restart_anneal_steps", mode="before")
    @classmethod
    def _off_means_the_default(cls, value: Any) -> Any:
        """Axolotl reads `false` or 0 here as its default (10 warm-up steps, 1 annealing step)."""
        return None if value in (False, 0) else value

    @model_validator(mode="after")
    def _schemes_complete(self) -> SchemeSettings:
        if (self.lisa_n_layers is None) != (self.lisa_step_interval is None):
            raise ValueError(
                "LISA needs lisa_n_layers (blocks trained at a time) and lisa_step_interval (every how many steps "
                "they change): set both, or neither"
            )
        if self.jagged_restart_steps and getattr(self, "lr_scheduler", None) == "one_cycle":
            raise ValueError("jagged_restart_steps scales the schedule step by step; one_cycle is not such a "
                             "schedule (as in Axolotl): choose another lr_scheduler")  # fmt: skip
        if self.relora and not self.jagged_restart_steps:
            raise ValueError("relora: true merges and restarts the adapters every jagged_restart_steps: set it")
        return self

    @property
    def samples_layers(self) -> bool:
        return self.lisa_n_layers is not None

    @property
    def prune_ratio(self) -> float:
        """The share of the adapters' optimizer state a ReLoRA restart zeroes (Axolotl's defaults)."""
        if self.relora_prune_ratio is not None:
            return self.relora_prune_ratio
        return FULL_RESET_RATIO if self.relora_prune_method == "reset" else 0.9
