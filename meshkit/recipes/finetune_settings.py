"""The fine-tuning recipe's own settings, under their Axolotl names (`meshkit.config.importing.axolotl.keys` says which
Axolotl keys land here and which become meshkit settings). Empty values mean unset (Axolotl writes `lora_r:`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from meshkit.data.dataset_entry import is_preference_type, is_stepwise_type
from meshkit.data.formats import DatasetEntry
from meshkit.recipes.preference_settings import PreferenceSettings
from meshkit.training.optimizers import OPTIMIZERS, LrGroup
from meshkit.training.schedules import SCHEDULERS
from meshkit.training.token_weights import EaftSettings
from meshkit.tuning.liger import LigerSettings
from meshkit.tuning.lisa import LisaSettings
from meshkit.tuning.lora_init import LoraInitError, PeftBlock, changes_base, lora_init_mode
from meshkit.tuning.qat import QATSettings
from meshkit.tuning.relora import ReloraSettings


class FinetuneSettings(PreferenceSettings, LisaSettings, ReloraSettings, EaftSettings, LigerSettings):
    """The recipe's own keys (Axolotl names); preference training's in `PreferenceSettings`, each scheme's beside
    the scheme (LISA, ReLoRA with its jagged restarts, EAFT, Liger)."""

    # model and tokenizer
    base_model: Path = Field(description="directory in save_pretrained layout: config.json, safetensors, tokenizer")
    base_model_config: Path | None = Field(None, description="directory of config.json; null = base_model")
    model_type: str = Field("AutoModelForCausalLM", description="AutoModelForCausalLM or a causal-LM class name")
    tokenizer_type: str | None = Field(None, description="AutoTokenizer or a tokenizer class name; null = auto")
    tokenizer_config: Path | None = Field(None, description="directory of the tokenizer files; null = base_model")
    tokenizer_use_fast: bool = Field(True, description="the fast (tokenizers) tokenizer where one exists")
    tokenizer_use_mistral_common: bool = Field(
        False, description="Mistral's own tokenizer (tekken.json, mistral-common)"
    )
    fix_untrained_tokens: bool | int | list[int] | None = Field(
        None, description="untrained rows of tokens the data uses start at the mean (a list: those token ids)"
    )
    added_tokens_overrides: dict[int, str] | None = Field(
        None, description="{added token id: new string}: reserved tokens renamed, their ids (and rows) kept"
    )
    overrides_of_model_config: dict[str, Any] | None = Field(None, description="config.json values replaced")
    attn_implementation: str | None = Field(
        None, description="sdpa | eager | flash_attention_2 | ...; null = the model's default (sdpa where it has it)"
    )
    special_tokens: dict[str, str] | None = Field(None, description="bos/eos/pad/unk tokens set (added if new)")
    tokens: tuple[str, ...] | None = Field(None, description="tokens added to the vocabulary (embeddings grow)")
    chat_template: str | None = Field(None, description="tokenizer_default | chatml | llama3 | ... | jinja")
    chat_template_jinja: str | None = Field(
        None, description="a Jinja chat template, or the path of a file holding one"
    )
    default_system_message: str | None = Field(None, description="system turn put first where a chat has none")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="arguments of the chat template (e.g. enable_thinking: false)"
    )
    eot_tokens: tuple[str, ...] | None = Field(
        None, description="end-of-turn tokens of the chat template: trained as train_on_eot says; stop generation"
    )
    # data
    datasets: tuple[DatasetEntry, ...] = Field((), description="[{path, type, ...}]")
    pretraining_dataset: tuple[DatasetEntry, ...] | None = Field(
        None, description="plain text streamed for continued pretraining: [{path, name, split, text_column, skip}]"
    )
    streaming: bool = Field(False, description="stream the datasets (read lazily, packed as they come; max_steps)")
    streaming_multipack_buffer_size: int = Field(10_000, ge=1, description="samples packed together when streamed")
    test_datasets: tuple[DatasetEntry, ...] | None = Field(None, description="validation data (instead of a split)")
    val_set_size: float = Field(0.0, ge=0, description="held-out share (< 1) or count (>= 1) of the samples")
    sample_packing: bool = Field(False, description="pack samples into sequence_len rows (no cross-sample attention)")
    pad_to_sequence_len: bool = Field(False, description="pad every batch to sequence_len")
    train_on_inputs: bool = Field(False, description="also train on prompt tokens")
    dataset_prepared_path: str | None = Field(
        None, description="directory keeping tokenized datasets for later runs; null = datasets' own cache only"
    )
    dataset_processes: int | None = Field(None, ge=1, description="tokenizing processes; null = this rank's CPUs")
    shuffle_merged_datasets: bool = Field(True, description="several datasets merged in a seeded random order")
    batch_size: int | None = Field(
        None,
        ge=1,
        description="Axolotl's older key: a rank's samples per step; gradient_accumulation_steps = "
        "batch_size // micro_batch_size when unset",
    )
    dataset_shard_num: int | None = Field(None, ge=1, description="train on one of this many shards of the records")
    dataset_shard_idx: int | None = Field(None, ge=0, description="which shard (with dataset_shard_num)")
    dataset_exact_deduplication: bool = Field(False, description="drop samples that repeat another exactly")
    curriculum_sampling: bool = Field(False, description="batches take the samples in their order (no shuffle)")
    dataset_keep_in_memory: bool = Field(False, description="hold the datasets in memory, not memory-mapped")
    # adapters
    adapter: Literal["lora", "qlora"] | None = Field(
        None, description="lora, qlora (LoRA over a 4-bit base), or null for a full fine-tune"
    )
    lora_r: int = Field(8, ge=1, description="LoRA rank")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator (scaling = alpha / r)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    lora_target_modules: str | tuple[str, ...] | None = Field(
        None,
        description="module names to adapt, e.g. [q_proj, v_proj]; one string: a regular expression peft "
        "matches against whole module paths",
    )
    lora_target_linear: bool = Field(False, description="adapt every Linear layer except the output head")
    lora_target_parameters: tuple[str, ...] | None = Field(
        None,
        description="parameters to adapt by name, e.g. [experts.gate_up_proj, experts.down_proj] (a "
        "mixture-of-experts bank: one low-rank update per expert); with or without lora_target_modules",
    )
    lora_model_dir: Path | None = Field(None, description="continue the adapter a LoRA run wrote there")
    peft_use_rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(r)")
    peft_use_dora: bool = Field(False, description="DoRA: LoRA plus a trained magnitude per output row")
    lora_modules_to_save: tuple[str, ...] | None = Field(
        None, description="modules trained whole beside the adapters and saved with them, e.g. [embed_tokens, lm_head]"
    )
    peft_layers_to_transform: tuple[int, ...] | None = Field(None, description="block indices adapted; null = all")
    peft_layers_pattern: str | tuple[str, ...] | None = Field(
        None, description="the name of the block list peft_layers_to_transform counts in (peft's layers_pattern)"
    )
    lora_rank_pattern: dict[str, int] | None = Field(
        None, description="{layer-name regex: rank} for layers that take another rank than lora_r (peft's rank_pattern)"
    )
    lora_alpha_pattern: dict[str, float] | None = Field(None, description="{layer regex: alpha} (alpha_pattern)")
    peft_init_lora_weights: bool | str | None = Field(
        None,
        description="how LoRA starts (peft's init_lora_weights): true (A random, B zero), false, gaussian, "
        "orthogonal, pissa, pissa_niter_<n>, olora, loftq (PiSSA/OLoRA/LoftQ also rewrite the frozen base)",
    )
    peft: PeftBlock | None = Field(None, description="Axolotl's peft block: loftq_config.loftq_bits (LoftQ)")
    # quantized base (bitsandbytes, through transformers' BitsAndBytesConfig)
    load_in_8bit: bool = Field(False, description="the frozen base in int8 (LLM.int8 Linear8bitLt)")
    load_in_4bit: bool = Field(False, description="the frozen base in 4 bits (Linear4bit; adapter: qlora)")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit code book")
    bnb_4bit_use_double_quant: bool = Field(True, description="the block scales quantized too")
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="dtype 4-bit matmuls run in; null = float32 (the trained weights' dtype)"
    )
    bnb_4bit_quant_storage: Literal["uint8", "float32", "bfloat16", "float16"] | None = Field(
        None, description="dtype the packed 4-bit weights are stored in; null = uint8"
    )
    bnb_config_kwargs: dict[str, Any] | None = Field(None, description="further BitsAndBytesConfig arguments")
    gptq: bool = Field(False, description="the base is a GPTQ checkpoint (its config.json says how)")
    model_quantization_config: Literal["Mxfp4Config", "FineGrainedFP8Config"] | None = Field(
        None, description="the format a base was released in: Mxfp4Config (gpt-oss) loads dequantized"
    )
    model_quantization_config_kwargs: dict[str, Any] | None = Field(None, description="its arguments (dequantize)")
    qat: QATSettings | None = Field(None, description="quantization-aware training (torchao fake quantization)")
    reinit_weights: bool = Field(False, description="start from the model's own random initialisation, not the weights")
    loraplus_lr_ratio: float | None = Field(None, gt=0, description="LoRA+: lr of the B matrices = ratio × lr")
    unfrozen_parameters: tuple[str, ...] | None = Field(None, description="train only parameters matching these")
    # schedule and optimizer
    num_epochs: float = Field(1.0, gt=0, description="epochs, when max_steps is not set")
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="warm-up share of the steps (or warmup_steps)")
    lr_scheduler: str = Field("cosine", description="a transformers get_scheduler name, or one_cycle")
    lr_scheduler_kwargs: dict[str, Any] | None = Field(None, description="the schedule's own arguments")
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1, description="cosine floor as a share of the lr")
    cosine_constant_lr_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="with cosine_min_lr_ratio: the floor is reached at this share of the steps, then held",
    )
    lr_quadratic_warmup: bool = Field(False, description="cosine: the warm-up rises as the square of its progress")
    embedding_lr: float | None = Field(None, gt=0, description="the embedding's and head's learning rate")
    embedding_lr_scale: float | None = Field(None, gt=0, description="or theirs as a multiple of learning_rate")
    lr_groups: tuple[LrGroup, ...] | None = Field(None, description="[{name, modules, lr}]: matrices at another lr")
    lr_div_factor: float | None = Field(None, gt=0, description="one_cycle: the starting lr is learning_rate / this")
    optimizer: str = Field(
        "adamw_torch", description="adamw_torch | adamw_bnb_8bit | paged_adamw_8bit | adamw_torch_4bit | sgd | ..."
    )
    optim_args: dict[str, Any] | None = Field(None, description="extra optimizer arguments")
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)
    tf32: bool = Field(False, description="TF32 matmuls on CUDA (no effect on a CPU)")
    # evaluation and stopping
    eval_steps: int | None = Field(None, ge=1, description="evaluate every N steps; null = at the end only")
    evals_per_epoch: int | None = Field(None, ge=1, description="evaluations per epoch (instead of eval_steps)")
    eval_batch_size: int | None = Field(None, ge=1, description="validation micro-batch; null = micro_batch_size")
    saves_per_epoch: int | None = Field(None, ge=1, description="checkpoints per epoch (instead of save_steps)")
    early_stopping_patience: int | None = Field(None, ge=1, description="stop after N evaluations without a new best")
    loss_watchdog_threshold: float | None = Field(None, gt=0, description="stop when the loss stays above this")
    loss_watchdog_patience: int = Field(3, ge=1, description="steps above loss_watchdog_threshold before stopping")
    # trackers
    wandb_project: str | None = Field(None, description="wandb project (turns the wandb tracker on)")
    wandb_entity: str | None = Field(None, description="wandb team or user")
    wandb_name: str | None = Field(None, description="wandb run name; null = output_dir's name")
    wandb_run_id: str | None = Field(None, description="wandb run id (resumes that run)")
    wandb_mode: str | None = Field(None, description="online | offline | disabled; null = online with credentials")
    # meshkit's own
    generation_samples: int = Field(3, ge=0, description="validation prompts answered (greedy) in the summary")
    generation_max_new_tokens: int = Field(24, ge=1, description="tokens generated per sample")

    @property
    def streams(self) -> bool:
        """The training data is streamed (`streaming: true`, or `pretraining_dataset`)."""
        return self.streaming or bool(self.pretraining_dataset)

    @property
    def loads_whole(self) -> bool:
        """The base loads whole through transformers (quantized, or a reward model whose new head the base lacks)
        instead of streaming into this rank's shards."""
        return bool(self.quantization or self.reward_model or self.process_reward_model)

    @property
    def lora_init(self) -> str | None:
        """The LoRA initialisation asked for, by peft's name; None for peft's default."""
        bits = self.peft.loftq_config.loftq_bits if self.peft and self.peft.loftq_config else None
        return lora_init_mode(self.peft_init_lora_weights, bits)

    @property
    def quantization(self) -> Literal["8bit", "4bit", "gptq"] | None:
        """How the (frozen) base model is quantized as it loads; None for a plain base. QLoRA is LoRA over the
        4-bit base, with or without load_in_4bit written."""
        if self.load_in_8bit:
            return "8bit"
        if self.load_in_4bit or self.adapter == "qlora":
            return "4bit"
        return "gptq" if self.gptq else None

    @field_validator("pretraining_dataset", mode="before")
    @classmethod
    def _pretraining_type(cls, value: Any) -> Any:
        """Axolotl's pretraining entries leave `type` out: plain text (`pretrain`)."""
        if isinstance(value, (list, tuple)):
            return [{"type": "pretrain", **entry} if isinstance(entry, dict) else entry for entry in value]
        return value

    @field_validator(
        "lora_target_parameters",
        "lora_modules_to_save",
        "unfrozen_parameters",
        "tokens",
        "eot_tokens",
        mode="before",
    )
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("evals_per_epoch", "saves_per_epoch", "eval_steps", mode="before")
    @classmethod
    def _zero_means_never(cls, value: Any) -> Any:
        """Axolotl writes 0 for no evaluations / saves."""
        return None if value in (0, "0") else value

    @field_validator("lr_scheduler", "optimizer")
    @classmethod
    def _one_meshkit_runs(cls, value: str, info: ValidationInfo) -> str:
        known, what = (SCHEDULERS, "a schedule") if info.field_name == "lr_scheduler" else (OPTIMIZERS, "an optimizer")
        if value not in known:
            raise ValueError(f"'{value}' is not {what} meshkit runs; choose one of {', '.join(known)}")
        return value

    @model_validator(mode="after")
    def _one_cadence_and_template(self) -> FinetuneSettings:
        """An evaluation cadence given once; a Jinja chat template with its text."""
        if self.eval_steps is not None and self.evals_per_epoch is not None:
            raise ValueError("set eval_steps or evals_per_epoch, not both")
        if self.chat_template == "jinja" and not self.chat_template_jinja:
            raise ValueError("chat_template: jinja needs chat_template_jinja (the template, or a file holding it)")
        return self

    @model_validator(mode="after")
    def _one_quantization_under_adapters(self) -> FinetuneSettings:
        """At most one quantization of the base, trained through adapters; QAT and reinit_weights on a whole
        model of their own; DoRA and lora_model_dir with what they need."""
        if self.load_in_8bit and (self.load_in_4bit or self.adapter == "qlora"):
            raise ValueError("load_in_8bit and load_in_4bit / adapter: qlora ask for two quantizations: keep one")
        if self.qat is not None and (self.adapter or self.load_in_8bit or self.load_in_4bit or self.gptq):
            raise ValueError(
                "qat trains the whole model's full-precision weights through fake quantization: drop adapter and "
                "load_in_8bit / load_in_4bit / gptq (as Axolotl, QAT goes with neither)"
            )
        if self.reinit_weights and self.loads_whole:
            raise ValueError(
                "reinit_weights starts a model built here from its own initialisation; a quantized base or a reward "
                "model's is loaded whole by transformers: drop reinit_weights or the quantization / reward keys"
            )
        if self.model_quantization_config == "FineGrainedFP8Config":
            raise ValueError(
                "model_quantization_config: FineGrainedFP8Config (a base released in block-scaled FP8) is not "
                "supported yet: start from the model's bf16 release"
            )
        if self.model_quantization_config and (self.load_in_8bit or self.load_in_4bit or self.gptq):
            raise ValueError("model_quantization_config and load_in_8bit / load_in_4bit / gptq ask for two "
                             "quantizations (as in Axolotl): keep one")  # fmt: skip
        if self.gptq and (self.load_in_8bit or self.load_in_4bit or self.adapter == "qlora"):
            raise ValueError("gptq: true loads an already quantized base: drop load_in_8bit / load_in_4bit / qlora")
        if self.quantization and self.adapter is None:
            raise ValueError(
                "a quantized base is frozen: train adapters over it (adapter: lora, or qlora for 4 bits), or drop "
                "load_in_8bit / load_in_4bit / gptq for a full fine-tune"
            )
        if self.peft_use_dora and self.quantization:
            raise ValueError("DoRA over a quantized base is not supported yet: drop peft_use_dora or the quantization")
        if self.lora_model_dir is not None and self.adapter is None:
            raise ValueError("lora_model_dir continues an adapter: set adapter: lora (or qlora)")
        return self

    @model_validator(mode="after")
    def _data_fits_the_kind_of_training(self) -> FinetuneSettings:
        """Training data given, of the kind the training reads: streams and packing for supervised training,
        pairs for rl / reward_model, step-labelled rows for process_reward_model; each head its number of
        labels; a dataset shard that exists."""
        if not self.datasets and not self.pretraining_dataset:
            raise ValueError("no training data: set datasets (or pretraining_dataset)")
        if self.streams and (self.rl is not None or self.reward_model):
            raise ValueError(
                "streamed data trains supervised: rl / reward_model read prepared datasets (drop streaming)"
            )
        if self.streams and (self.val_set_size or self.test_datasets):
            raise ValueError("a stream holds no validation split: drop val_set_size / test_datasets, or streaming")
        if self.rl is None and not self.reward_model and any(is_preference_type(e.type) for e in self.datasets):
            raise ValueError(
                "preference data (chat_template.default, chatml.*, llama3.*, bradley_terry.*, ...) needs rl: dpo (or "
                "ipo, kto, orpo, simpo) or reward_model: true"
            )
        if self.reward_model and (self.rl is not None or self.sample_packing):
            raise ValueError(
                "reward_model: true trains a sequence-classification model on unpacked pairs: drop rl and "
                "sample_packing"
            )
        if self.num_labels not in (None, 1) and self.reward_model:
            raise ValueError("a reward model has one output: num_labels: 1 (or leave it unset)")
        stepwise = [is_stepwise_type(entry.type) for entry in (*self.datasets, *(self.test_datasets or ()))]
        if self.process_reward_model and (self.rl is not None or self.reward_model or self.sample_packing):
            raise ValueError(
                "process_reward_model: true trains a token-classification model on unpacked rows: drop rl, "
                "reward_model and sample_packing"
            )
        if self.process_reward_model and not all(stepwise):
            raise ValueError(
                "a process reward model reads type: stepwise_supervised datasets (prompt, completions, labels)"
            )
        if any(stepwise) and not self.process_reward_model:
            raise ValueError("stepwise_supervised data trains a process reward model: set process_reward_model: true")
        if self.process_reward_model and self.num_labels not in (None, 2):
            raise ValueError(
                "a process reward model judges each step right or wrong: num_labels: 2 (or leave it unset)"
            )
        if self.rl is not None and self.sample_packing:
            raise ValueError(f"rl: {self.rl} runs unpacked rows (as TRL does): set sample_packing: false")
        if (self.dataset_shard_num is None) != (self.dataset_shard_idx is None):
            raise ValueError("dataset_shard_num and dataset_shard_idx go together: set both, or neither")
        shards = (self.dataset_shard_num, self.dataset_shard_idx)
        if shards[0] is not None and shards[1] is not None and shards[1] >= shards[0]:
            raise ValueError(
                f"dataset_shard_idx {self.dataset_shard_idx} of dataset_shard_num {self.dataset_shard_num}: shards "
                "count from 0"
            )
        return self

    @model_validator(mode="after")
    def _restarts_fit_the_schedule(self) -> FinetuneSettings:
        """Jagged restarts scale a schedule step by step, which one_cycle is not."""
        if self.jagged_restart_steps and self.lr_scheduler == "one_cycle":
            raise ValueError("jagged_restart_steps scales the schedule step by step; one_cycle is not such a "
                             "schedule (as in Axolotl): choose another lr_scheduler")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _lora_init_fits(self) -> FinetuneSettings:
        try:
            mode = self.lora_init
        except LoraInitError as err:
            raise ValueError(str(err)) from None
        if mode is None:
            return self
        if self.adapter is None:
            raise ValueError(f"peft_init_lora_weights: {mode} starts LoRA adapters: set adapter: lora, or drop the key")
        if changes_base(mode) and self.quantization:
            raise ValueError(
                f"{mode} rewrites the base weights, which a quantized base cannot take: use adapter: lora over the "
                "plain base (LoftQ quantizes it itself), or the default initialisation"
            )
        if self.peft_use_dora:
            raise ValueError(f"peft_init_lora_weights: {mode} with DoRA is not supported: drop one of them")
        if changes_base(mode) and self.rl is not None and not self.precompute_ref_log_probs:
            raise ValueError(
                f"{mode} rewrites the base, so the base with adapters off is not the untrained model DPO compares "
                "against: set precompute_ref_log_probs: true (the untrained model scored once before training)"
            )
        return self
