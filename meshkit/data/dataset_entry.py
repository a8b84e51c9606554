"""One entry of a fine-tune's `datasets:` list, with Axolotl's per-dataset keys: where the records are, their
type, and how a record's fields map onto that type (`field_messages`, `message_property_mappings`, `roles`, ...).
Empty values mean unset, as in Axolotl's configs."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from meshkit.config.section import Section
from meshkit.data.instruction_types import INSTRUCTION_TYPES

ALPACA_VARIANTS = ("alpaca", "alpaca:chat", "alpaca_chat", "alpaca:phi", "alpaca_phi", "alpaca_w_system")
DATASET_TYPES: tuple[str, ...] = (
    *ALPACA_VARIANTS,
    "chat_template",
    "sharegpt",
    "completion",
    "input_output",
    "pretrain",
    *INSTRUCTION_TYPES,
)
PREFERENCE_TYPES = ("chatml", "llama3", "zephyr", "user_defined", "passthrough", "bradley_terry")  # + chat_template.*
STEPWISE_TYPE = "stepwise_supervised"  # a process reward model's records: prompt, completions (steps), labels
STEPWISE_KEYS = ("step_separator", "max_completion_length", "train_on_last_step_only")  # (its entries' own keys)
DEFAULT_ROLES = {"user": ["human", "user"], "assistant": ["gpt", "assistant", "model"], "system": ["system"]}


def without_empty(data: Any) -> Any:
    """A mapping's keys left empty (Axolotl writes `key:` for unset) dropped."""
    if isinstance(data, dict):
        return {key: value for key, value in data.items() if value not in (None, "", [], {})}
    return data


class CustomPrompt(Section):
    """Axolotl's user-defined prompt type: which fields hold what, and the prompt formats."""

    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field_system: str = "system"
    format: str = Field("{instruction}\n{input}\n", description="prompt with an input")
    no_input_format: str = Field("{instruction}\n", description="prompt without an input")
    system_prompt: str = ""
    system_format: str = "{system}\n"


class PreferencePrompt(Section):
    """Axolotl's user-defined preference type: which fields hold what, and the formats of prompt and replies."""

    field_prompt: str = "prompt"
    field_system: str = "system"
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"
    field_completion: str = "completion"  # KTO
    field_label: str = "label"  # KTO
    prompt_format: str = "{prompt}"
    chosen_format: str = "{chosen}"
    rejected_format: str = "{rejected}"
    completion_format: str = "{completion}"

    @model_validator(mode="before")
    @classmethod
    def _empty_means_unset(cls, data: Any) -> Any:
        return without_empty(data)


class DatasetEntry(Section):
    path: str = Field(description="a local file or directory, or a hub dataset name found in this machine's caches")
    type: str | CustomPrompt | PreferencePrompt | None = Field(
        None,
        description="alpaca (and variants) | chat_template | completion | input_output; with rl: "
        "chat_template.default | chatml.* | llama3.* | ... (see meshkit.data.preference_formats); empty: the "
        "records are tokenized already (input_ids, and labels or every token trained)",
    )
    split: str = Field("train", description="the split read (a file alone holds 'train')")
    name: str | None = Field(None, description="the dataset's configuration (subset) name")
    data_files: str | tuple[str, ...] | None = Field(None, description="files within a directory or hub dataset")
    ds_type: Literal["json", "parquet", "csv", "arrow", "text"] | None = Field(
        None, description="the files' format where their suffix does not say"
    )
    revision: str | None = Field(None, description="the hub dataset's revision")
    field: str | None = Field(None, description="completion: the field holding the text; null = text")
    text_column: str | None = Field(None, description="pretraining_dataset: the field holding the text; null = text")
    skip: int | None = Field(None, ge=0, description="pretraining_dataset: records skipped at the stream's start")
    field_messages: str | None = Field(None, description="chat_template: the field holding the turns; null = messages")
    field_chosen: str | None = Field(None, description="preference data: the field of the chosen reply; null = chosen")
    field_rejected: str | None = Field(None, description="preference data: the rejected reply's; null = rejected")
    message_property_mappings: dict[str, str] | None = Field(None, description="{role: from, content: value}")
    message_field_role: str | None = Field(None, description="older form of message_property_mappings.role")
    message_field_content: str | None = Field(None, description="older form of message_property_mappings.content")
    roles: dict[str, list[str]] | None = Field(None, description="{user: [human, user], assistant: [gpt], ...}")
    roles_to_train: tuple[str, ...] | None = Field(None, description="roles whose turns train; null = [assistant]")
    train_on_eos: Literal["turn", "all", "last", "none"] | None = Field(None, description="which EOS train")
    train_on_eot: Literal["turn", "all", "last", "none"] | None = Field(
        None, description="which end-of-turn tokens (eot_tokens) train; null = as train_on_eos"
    )
    drop_system_message: bool = Field(False, description="leave system turns out")
    field_system: str | None = Field(None, description="chat_template: a record's system text; null = system")
    field_tools: str | None = Field(None, description="chat_template: a record's tool definitions; null = tools")
    field_thinking: str | None = Field(None, description="a turn's reasoning; null = reasoning_content")
    template_thinking_key: str | None = Field(
        None, description="the template's reasoning property; null = reasoning_content"
    )
    split_thinking: bool = Field(False, description="move <think>...</think> out of an assistant's content")
    message_field_training: str | None = Field(None, description="a turn's key saying whether it trains")
    message_field_training_detail: str | None = Field(
        None, description="a turn's key holding [{begin_offset, end_offset, train}] spans of its content"
    )
    shards: int | None = Field(None, ge=1, description="split the records into this many shards (with shards_idx)")
    shards_idx: int | None = Field(None, ge=0, description="the shard read; null = 0")
    step_separator: str = Field("\n", description="stepwise_supervised: the text after each step (its label's token)")
    max_completion_length: int | None = Field(
        None, ge=1, description="stepwise_supervised: the steps' tokens cut to this many; null = no cut"
    )
    train_on_last_step_only: bool = Field(False, description="stepwise_supervised: only the last step's label trains")
    chat_template: str | None = Field(None, description="this dataset's chat template (a name, or jinja)")
    chat_template_jinja: str | None = Field(None, description="the template for chat_template: jinja")

    @model_validator(mode="before")
    @classmethod
    def _empty_means_unset(cls, data: Any) -> Any:
        return without_empty(data)

    @model_validator(mode="after")
    def _shard_in_range(self) -> DatasetEntry:
        if self.shards_idx is not None and self.shards is None:
            raise ValueError(f"dataset '{self.path}': shards_idx needs shards (how many shards)")
        if self.shards is not None and (self.shards_idx or 0) >= self.shards:
            raise ValueError(
                f"dataset '{self.path}': shards_idx {self.shards_idx} of {self.shards} shards: it counts from 0"
            )
        return self

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        if isinstance(value, str):
            base = value.split(".", 1)[0]  # Axolotl's `alpaca_w_system.load_open_orca` form
            if base not in (*DATASET_TYPES, *PREFERENCE_TYPES, STEPWISE_TYPE):
                raise ValueError(
                    f"'{value}' is not a dataset type meshkit reads; choose one of {', '.join(DATASET_TYPES)} (with "
                    f"rl: {', '.join(PREFERENCE_TYPES)}; with process_reward_model: {STEPWISE_TYPE})"
                )
        return value

    @field_validator("path", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    def mappings(self) -> dict[str, str]:
        """Message property -> record key (role, content)."""
        out = {"role": "role", "content": "content"}
        if self.message_field_role:
            out["role"] = self.message_field_role
        if self.message_field_content:
            out["content"] = self.message_field_content
        return {**out, **(self.message_property_mappings or {})}

    def role_names(self) -> dict[str, str]:
        """A record's role name -> the template's role."""
        table = {**DEFAULT_ROLES, **(self.roles or {})}
        return {source: target for target, sources in table.items() for source in sources}


def is_stepwise_type(kind: str | CustomPrompt | PreferencePrompt | None) -> bool:
    """A process reward model's step-labelled records (`stepwise_supervised`)."""
    return isinstance(kind, str) and kind.split(".", 1)[0] == STEPWISE_TYPE


def is_preference_type(kind: str | CustomPrompt | PreferencePrompt | None) -> bool:
    """A type of preference data (pairs or KTO's labelled completions), read only with `rl:`."""
    if isinstance(kind, PreferencePrompt):
        return True
    if kind is None or isinstance(kind, CustomPrompt):
        return False
    family, _, variant = kind.partition(".")
    return family in PREFERENCE_TYPES or (family == "chat_template" and bool(variant))
