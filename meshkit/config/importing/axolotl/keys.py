"""Every Axolotl config key meshkit knows, in one table of three kinds:

- *honoured*: mapped onto a meshkit setting (`to="train.lr"`), a recipe setting (`to="recipe"` or
  `"recipe.<name>"`), or read by a function that sets several (`reader`);
- *noted*: asks for something with no effect here; one notice line, the run goes on;
- *refused*: a feature meshkit does not have; one line naming what to do instead.

An empty value (`lora_r:`) means unset, and a refused or noted key switched off (`false`, `0`) asks for nothing:
both pass silently. The key table of docs/fine-tuning.md is rendered from this one (`render_table`); a test keeps
them equal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from meshkit.config.importing.axolotl import layout
from meshkit.config.importing.axolotl.further_keys import FURTHER_RULES
from meshkit.config.importing.axolotl.plugin_keys import PLUGIN_RULES
from meshkit.config.importing.axolotl.rules import KeyRule, Rules, add_rule, honoured, noted, refused


def _on(value: Any) -> bool:
    return value in (True, "true", "True", "auto")


def _precision(flag: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if value == "auto":  # Axolotl: on where the device supports it; elsewhere left to other keys
            import torch

            supported = torch.cuda.is_available() and (flag == "fp16" or torch.cuda.is_bf16_supported())
            return flag if supported else None
        return flag if _on(value) else None

    return convert


def _attention(implementation: str) -> Callable[[Any], Any]:
    return lambda value: implementation if _on(value) else None


def _off_means_none(value: Any) -> Any:
    return "full" if _on(value) else "none"


_ATTENTION_KERNEL = "a CUDA kernel; the model's own modules run (same loss, no fused kernel)"
_NO_HUB = "no hub access here: the outputs stay in output_dir (merged/ holds the model)"
_TRACKER = "metrics go to jsonl, and to tensorboard / wandb when asked; this tracker is not one of them"

# fmt: off
_RULES: Rules = []


def _warmup(name: str, value: Any, sink: Any) -> None:
    if isinstance(value, float) and 0 < value < 1:
        sink.recipe["warmup_ratio"] = value
    else:
        sink.set("train.warmup_steps", int(value), name)


def _fused_loss(value: Any) -> str:
    return "auto" if _on(value) else "off"


def _plugins(name: str, value: Any, sink: Any) -> None:
    """Axolotl's plugin list: Cut Cross-Entropy is meshkit's fused loss; a plugin's keys have their own rows."""
    plugins = [value] if isinstance(value, str) else list(value or [])
    for plugin in plugins:
        short = str(plugin).rsplit(".", 1)[-1]
        if "cut_cross_entropy" in str(plugin) or short == "CutCrossEntropyPlugin":
            sink.set("fused_loss", "auto", name)
        elif "liger" not in str(plugin).lower():
            sink.notes.append(f"plugins: {short}: {_ATTENTION_KERNEL}")


def _tokens(name: str, value: Any, sink: Any) -> None:
    """`special_tokens`, and `tokens`: tokens to add — or, as Axolotl's early configs wrote it, a mapping of
    special tokens, read as `special_tokens` (whose own values win, whichever key comes first)."""
    earlier = sink.recipe.get("special_tokens")
    if name == "tokens" and isinstance(value, dict):
        sink.notes.append(f"tokens: {', '.join(value)} is Axolotl's early spelling of special_tokens: read as such")
        sink.recipe["special_tokens"] = {**value, **(earlier if isinstance(earlier, dict) else {})}
    elif name == "special_tokens" and isinstance(value, dict) and isinstance(earlier, dict):
        sink.recipe["special_tokens"] = {**earlier, **value}
    else:
        sink.recipe[name] = value


def _add(group: str, names: tuple[str, ...] | str, rule: KeyRule) -> None:
    add_rule(_RULES, group, names, rule)


G = "model and tokenizer"
_add(G, "base_model", honoured("a local save_pretrained directory (config.json, safetensors, tokenizer)"))
_add(G, ("base_model_config", "tokenizer_config"), honoured("directory of config.json / of the tokenizer files"))
_add(G, ("model_type", "tokenizer_type"),
     honoured("AutoModelForCausalLM or a causal-LM class (another package's class, e.g. mamba_ssm's "
              "MambaLMHeadModel: the checkpoint's own transformers class, noted); AutoTokenizer or a class"))
_add(G, "tokenizer_use_fast", honoured("the fast (tokenizers) tokenizer, or the slow one"))
_add(G, "overrides_of_model_config", honoured("config.json values replaced before the model is built"))
_add(G, "model_config", honoured("Axolotl's older name of overrides_of_model_config",
                                 "recipe.overrides_of_model_config"))
_add(G, "attn_implementation", honoured("the model's attention (unset: the model's own default, sdpa where its class "
                                        "has it); a kernel not installed here (flash) runs sdpa, noted"))
_add(G, "sdp_attention", honoured("attn_implementation: sdpa", "recipe.attn_implementation", _attention("sdpa")))
_add(G, "flash_attention", honoured("attn_implementation: flash_attention_2 (sdpa where flash-attn is missing, "
                                    "noted)", "recipe.attn_implementation", _attention("flash_attention_2")))
_add(G, ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm"),
     honoured("Liger's Triton kernels through the liger-kernel package, on CUDA where it is installed (its own "
              "patching, by model type); elsewhere one notice line and the model's own modules run"))
_add(G, ("xformers_attention", "flash_attn_cross_entropy", "flash_attn_rms_norm", "flash_attn_fuse_qkv",
         "flash_attn_fuse_mlp",
         "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o", "unsloth_rms_norm", "unsloth_rope", "kernels"),
     noted(_ATTENTION_KERNEL))
_add(G, ("cut_cross_entropy", "liger_fused_linear_cross_entropy", "chunked_cross_entropy"),
     honoured("meshkit's fused loss: cross-entropy from the head's input and weight in token chunks, the logits "
              "never whole, on every device and layout (`fused_loss: auto`, the default: where the model returns its "
              "head's output as its logits); false = `fused_loss: off`", "fused_loss", _fused_loss))
_add(G, "plugins", honoured("CutCrossEntropyPlugin: meshkit's fused loss (`fused_loss: auto`); the Liger and other "
                            "plugins' keys are read one by one; a kernel plugin alone is noted", reader=_plugins))
_add(G, ("special_tokens", "tokens"),
     honoured("bos/eos/pad/unk set on the tokenizer, tokens added to it; the embedding (and head) grow, new rows "
              "at the mean of the others; saved with the outputs. `tokens:` as a mapping of bos_token, ... "
              "(Axolotl's early configs) is read as special_tokens, noted", reader=_tokens))
_add(G, ("chat_template", "chat_template_jinja", "default_system_message"),
     honoured("the tokenizer's chat template: tokenizer_default, a built-in one by Axolotl's name, or jinja; "
              "Axolotl's names of templates a family's tokenizers ship (cohere, llama4, deepseek_v3, ...) take the "
              "tokenizer's own, with a notice"))
_add(G, "eot_tokens", honoured("end-of-turn tokens: trained as the dataset's train_on_eot says (default: as "
                               "train_on_eos), and they end the summary's generated answers"))
_add(G, "trust_remote_code", noted("transformers' own model classes load the model; no remote code runs"))
_add(G, ("is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model", "is_falcon_derived_model",
         "model_config_type"), noted("the model family is read from config.json"))
_add(G, ("low_cpu_mem_usage", "resize_token_embeddings_to_32x", "tokenizer_legacy", "model_revision",
         "revision_of_model", "max_memory", "gpu_memory_limit", "lora_on_cpu"),
     noted("no effect here: weights stream in one tensor at a time into this rank's shards"))
_add(G, ("processor_type", "image_size", "image_resize_algorithm"),
     refused("multimodal processors are not supported: fine-tune the text model"))

G = "data"
_add(G, "datasets", honoured("through Hugging Face datasets: local json/jsonl/parquet/csv/arrow files and directories "
                             "(data_files, split, name, ds_type), hub names from this machine's caches; alpaca (and "
                             "its variants), chat_template (field mappings, roles_to_train, train_on_eos), completion "
                             "(field), input_output"))
_add(G, "test_datasets", honoured("validation data read like datasets (instead of val_set_size)"))
_add(G, "val_set_size", honoured("a share (< 1) or count (>= 1) of the samples held out, seeded"))
_add(G, "sequence_len", honoured("train.seq_len", "train.seq_len"))
_add(G, ("sample_packing", "train_on_inputs", "pad_to_sequence_len"),
     honoured("pack samples first-fit into sequence_len rows / train on prompt tokens / pad batches to sequence_len"))
_add(G, ("eval_sample_packing", "sample_packing_group_size", "sample_packing_bin_size",
         "sample_packing_sequentially", "multipack_real_batches", "batch_flattening"),
     noted("packing is first-fit in order; evaluation runs unpacked (the same loss per sample)"))
_add(G, "dataset_prepared_path",
     honoured("tokenized datasets kept there, reused while data, tokenizer and settings are unchanged"))
_add(G, ("dataset_processes", "dataset_num_proc"),
     honoured("processes tokenizing (datasets.map num_proc); default: the rank's share of the CPUs",
              "recipe.dataset_processes"))
_add(G, ("shuffle_merged_datasets", "dataset_keep_in_memory"),
     honoured("several datasets merged in a seeded random order / datasets held in memory"))
_add(G, "skip_prepare_dataset", noted("datasets are tokenized once at start (and kept at dataset_prepared_path)"))
_add(G, ("push_dataset_to_hub", "hf_use_auth_token"), noted(_NO_HUB))
_add(G, "group_by_length", noted("batches are drawn shuffled; grouping by length would only save padding"))
_add(G, ("pretraining_dataset", "streaming", "streaming_multipack_buffer_size"),
     honoured("streamed through datasets: each rank reads its share, tokenizes as it reads and packs each buffer of "
              "streaming_multipack_buffer_size samples into sequence_len rows; resumes where it stopped; needs "
              "max_steps"))
_add(G, "pretrain_multipack_buffer_size", honoured("Axolotl's older name of streaming_multipack_buffer_size",
                                                   "recipe.streaming_multipack_buffer_size"))
_add(G, "pretrain_multipack_attn", noted("packed samples never attend to each other here (positions restart)"))

G = "preference training"
_add(G, "rl", honoured("dpo, ipo, kto, orpo, simpo with TRL's definitions, in DDP, ZeRO-1/2/3, tp, cp and pp; the "
                       "reference: adapters off (LoRA), a frozen copy (full), or precompute_ref_log_probs"))
_add(G, ("rl_beta", "dpo_loss_type", "dpo_loss_weights", "dpo_label_smoothing", "rpo_alpha", "orpo_alpha",
         "simpo_gamma", "cpo_alpha", "kto_desirable_weight", "kto_undesirable_weight", "precompute_ref_log_probs"),
     honoured("TRL's beta, loss_type, loss_weights, label_smoothing (robust/exo_pair/aot), RPO's sft weight, ORPO's "
              "beta, SimPO's gamma and cpo_alpha, KTO's weights, the reference scored once before training"))
_add(G, "dpo_beta", honoured("Axolotl's older name of rl_beta", "recipe.rl_beta"))
_add(G, ("dpo_use_liger_kernel", "dpo_padding_free", "max_prompt_len", "remove_unused_columns",
         "dpo_generate_during_eval", "dpo_use_logits_to_keep"),
     noted("a GPU kernel / padding layout / column handling of TRL's; rows are cut to sequence_len as TRL does"))
_add(G, "dpo_use_weighting",
     honoured("WPO (TRL's use_weighting): each pair's loss × exp of the policy's mean log p − log Σp² over each "
              "reply's tokens, in every layout (vocab-parallel under tp)"))
_add(G, ("reward_model", "num_labels", "center_rewards_coefficient"),
     honoured("a reward model: a sequence-classification head (1 label) trained with TRL's Bradley-Terry loss on "
              "bradley_terry.chat_template (or any pair type) data, full or LoRA (the head trains whole), in every "
              "layout; merged/ loads with AutoModelForSequenceClassification"))
_add(G, "process_reward_model",
     honoured("a process reward model: a token-classification head (2 labels) judges each step of stepwise_supervised "
              "data at its last token (step_separator, train_on_last_step_only, max_completion_length), full or "
              "LoRA, in every layout; merged/ loads with AutoModelForTokenClassification"))
_add(G, "trl", refused("the trl: block configures online RL (GRPO, vLLM generation), which meshkit does not run; "
                       "rl_beta sets beta"))

G = "adapters"
_add(G, "adapter", honoured("lora (peft); qlora: LoRA over the 4-bit base; empty for a full fine-tune"))
_add(G, ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear"),
     honoured("peft LoraConfig (lora_target_linear: every Linear but the head). A transformers-4 expert name "
              "(down_proj, w1, ...) peft moves onto the fused expert bank of transformers 5, as it loads; such "
              "adapters take no lora_dropout (the Linear layers' do), noted"))
_add(G, "peft_use_rslora", honoured("peft's rank-stabilised scaling alpha / sqrt(r)"))
_add(G, "peft_layers_to_transform", honoured("peft layers_to_transform: only these blocks are adapted"))
_add(G, "loraplus_lr_ratio", honoured("LoRA+: the B matrices learn at ratio × learning_rate"))
_add(G, "unfrozen_parameters", honoured("full fine-tune of the parameters matching these regexes; the rest frozen"))
_add(G, "lora_fan_in_fan_out", noted("set from the layer type (GPT-2's Conv1D) by peft"))
_add(G, ("merge_lora", "merge_method"), noted("the merged model is always written to output_dir/merged"))
_add(G, "loraplus_lr_embedding", noted("no embedding is adapted by lora_target_modules here"))
_add(G, "lora_model_dir", honoured("continue that adapter: its adapter_config.json and weights, in any layout"))
_add(G, "peft_use_dora", honoured("DoRA through peft (magnitude per output row), in every layout but tp; "
                                  "merged/ folds it"))
_add(G, "lora_modules_to_save", honoured("peft modules_to_save: those modules train whole beside the adapters "
                                         "(e.g. the embedding and head for added tokens); not with tp or pp"))
_add(G, ("load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
         "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage", "bnb_config_kwargs"),
     honoured("the frozen base quantized as it loads (bitsandbytes through transformers' BitsAndBytesConfig, "
              "CPU too); adapters train over it in one process, DDP, ZeRO-1/2, and ZeRO-3 for 4 bits; merged/ is "
              "dequantized"))
_add(G, "gptq", honoured("a GPTQ base loads through transformers where gptqmodel is installed; else refused in one "
                         "line"))
_add(G, ("peft_init_lora_weights", "peft"),
     honoured("peft's init_lora_weights: gaussian, orthogonal, false, pissa (pissa_niter_<n>), olora, loftq (or "
              "peft.loftq_config.loftq_bits), run by peft on each whole layer of the base in every layout; PiSSA/OLoRA "
              "adapters are exported for the original base (rank 2r); eva/corda/lora_ga are refused"))
_add(G, "peft_layer_replication",
     refused("LoRA starts from peft's default initialisation on the listed modules: remove the key"))
_add(G, ("relora", "relora_prune_ratio", "relora_prune_method"),
     honoured("ReLoRA: every jagged_restart_steps the adapters merge into the base (a 4/8-bit base through peft), "
              "start afresh, and their Adam moments are pruned (magnitude 0.9 / random / reset 0.999), in every "
              "layout but ZeRO-1/2; the output is the merged model"))
_add(G, "lora_target_parameters", honoured("peft target_parameters: LoRA on parameters, e.g. a mixture-of-experts "
                                           "bank (one low-rank update per expert), in every layout, parallel.ep "
                                           "included"))

G = "training"
for name, target in (("micro_batch_size", "train.micro_batch_size"),
                     ("gradient_accumulation_steps", "grad_accum_steps"), ("max_steps", "train.steps"),
                     ("learning_rate", "train.lr"),
                     ("weight_decay", "train.weight_decay"), ("logging_steps", "train.log_every"),
                     ("max_grad_norm", "max_grad_norm"), ("seed", "seed")):
    _add(G, name, honoured(f"`{target}`", target))
_add(G, "num_epochs", honoured("epochs, when max_steps is not set"))
_add(G, "warmup_steps", honoured("`train.warmup_steps`; a fraction under 1 is a share of the steps (warmup_ratio), as "
                                 "transformers 5 reads it", reader=_warmup))
_add(G, "warmup_ratio", honoured("warm-up steps = ratio × total steps (rounded up)"))
_add(G, ("lr_scheduler", "lr_scheduler_kwargs", "cosine_min_lr_ratio"),
     honoured("transformers' get_scheduler by name (cosine, linear, constant, constant_with_warmup, "
              "cosine_with_min_lr, ...) or one_cycle; cosine_min_lr_ratio = cosine with a floor"))
_add(G, ("optimizer", "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon"),
     honoured("torch AdamW / SGD, transformers Adafactor, bitsandbytes 8-bit (adamw_bnb_8bit, adamw_8bit, "
              "paged_adamw_8bit, lion_8bit, ...), torchao low-bit AdamW (adamw_torch_8bit, adamw_torch_4bit, "
              "ao_adamw_fp8), muon (torch's Muon for the hidden matrices, AdamW for the rest; not with zero_stage "
              "1/2)"))
_add(G, "bf16", honoured("`precision: bf16` (true; auto = where the device has it)", "precision", _precision("bf16")))
_add(G, "fp16", honoured("`precision: fp16`", "precision", _precision("fp16")))
_add(G, ("bfloat16", "float16", "fp8"), noted("weights stay fp32 masters; precision: bf16/fp16 runs mixed precision"))
_add(G, "tf32", honoured("TF32 matmuls on CUDA; no effect on a CPU (noted)"))
_add(G, "gradient_checkpointing", honoured("`activation_checkpointing.mode: full`", "activation_checkpointing.mode",
                                           _off_means_none))
_add(G, "gradient_checkpointing_kwargs", honoured("use_reentrant: false is what meshkit does; true is noted",
                                                  reader=layout.checkpointing_kwargs))
_add(G, "activation_offloading", honoured("`activation_offload`", "activation_offload", _on))
_add(G, "torch_compile", honoured("`compile.enabled`", "compile.enabled", _on))
_add(G, "torch_compile_backend", honoured("`compile.backend`", "compile.backend"))
_add(G, "torch_compile_mode", honoured("`compile.mode`", "compile.mode"))
_add(G, ("loss_watchdog_threshold", "loss_watchdog_patience"),
     honoured("stop with one line when the loss stays above the threshold for patience steps"))
_add(G, "early_stopping_patience", honoured("stop after this many evaluations without a new best eval loss"))
_add(G, "ddp_timeout", honoured("`collective_timeout_s`", "collective_timeout_s"))
_add(G, "ddp_bucket_cap_mb", honoured("`ddp.bucket_cap_mb`", "ddp.bucket_cap_mb"))
_add(G, "ddp_broadcast_buffers", honoured("`ddp.broadcast_buffers`", "ddp.broadcast_buffers"))
_add(G, "ddp_find_unused_parameters", honoured("`ddp.find_unused_parameters`", "ddp.find_unused_parameters"))
_add(G, ("local_rank", "strict", "debug", "include_tokens_per_second", "use_cache"),
     noted("no effect: ranks come from the launcher, keys are always checked, tokens/s is always reported"))
_add(G, ("neftune_noise_alpha", "noisy_embedding_alpha"),
     honoured("NEFTune: uniform noise of ±alpha/sqrt(seq·hidden) on the input embeddings while training, as "
              "transformers' Trainer adds it (`neftune_noise_alpha`; noisy_embedding_alpha is Axolotl's older name)",
              "neftune_noise_alpha"))
_add(G, ("optim_target_modules", "s2_attention"), refused("not supported: remove the key"))
_add(G, "lr_quadratic_warmup", honoured("cosine: the warm-up rises as the square of its progress"))

G = "evaluation and checkpoints"
_add(G, ("eval_steps", "evals_per_epoch", "eval_batch_size"),
     honoured("evaluate every N steps, or N times per epoch (and at the end), in batches of eval_batch_size"))
_add(G, "eval_max_new_tokens", honoured("tokens generated per sample", "recipe.generation_max_new_tokens"))
_add(G, "eval_table_size", honoured("validation prompts answered in the summary", "recipe.generation_samples"))
_add(G, ("eval_strategy", "evaluation_strategy", "save_strategy", "eval_causal_lm_metrics", "do_causal_lm_eval",
         "save_safetensors", "save_first_step", "save_only_model"),
     noted("evaluation follows eval_steps; checkpoints hold the full state; exports are always safetensors"))
_add(G, "output_dir", honoured("`logging.dir`", "logging.dir"))
_add(G, "save_steps", honoured("`checkpoint.every_steps`", "checkpoint.every_steps"))
_add(G, "saves_per_epoch", honoured("checkpoints per epoch (instead of save_steps)"))
_add(G, "save_total_limit", honoured("`checkpoint.keep_last`", "checkpoint.keep_last"))
_add(G, "resume_from_checkpoint", honoured("`checkpoint.resume`: that checkpoint", "checkpoint.resume"))
_add(G, "auto_resume_from_checkpoints", honoured("`checkpoint.resume: auto`", "checkpoint.resume",
                                                 lambda v: "auto" if _on(v) else None))
_add(G, ("hub_model_id", "hub_strategy", "push_to_hub", "hub_private_repo"), noted(_NO_HUB))

G = "layout"
_add(G, "deepspeed", honoured("the DeepSpeed JSON through meshkit's importer (ZeRO stage, offload, bf16, ...); "
                              "Axolotl's stock deepspeed_configs/*.json by name where the file is absent",
                              reader=layout.deepspeed))
_add(G, ("fsdp", "fsdp_config", "fsdp_version"),
     honoured("FSDP as ZeRO-3 (shard_grad_op: 2, hybrid_shard: HSDP), offload_params, reshard_after_forward, "
              "activation_checkpointing; keys that tune FSDP1 are noted", reader=layout.fsdp))
_add(G, "dp_shard_size", honoured("`parallel.dp_shard`", "parallel.dp_shard"))
_add(G, "dp_replicate_size", honoured("`parallel.dp_replicate`", "parallel.dp_replicate"))
_add(G, "tensor_parallel_size", honoured("`parallel.tp`", "parallel.tp"))
_add(G, ("context_parallel_size", "sequence_parallel_degree"),
     honoured("`parallel.cp` (ring attention)", "parallel.cp"))
_add(G, ("heads_k_stride", "ring_attn_func"), noted("meshkit's ring attention passes whole K/V blocks around the ring"))
_add(G, "expert_parallel_size", honoured("`parallel.ep` (experts split over the data-parallel ranks)", "parallel.ep"))
_add(G, ("use_ray", "ray_num_workers", "resources_per_worker"),
     honoured("`launch.backend: ray`, `launch.ray_num_workers`, `launch.ray_cpus_per_worker` / `ray_gpus_per_worker`",
              reader=layout.ray))
_add(G, "ray_run_name", noted("Ray names no run here: the run is its `logging.dir` (output_dir)"))

G = "trackers"
_add(G, ("wandb_project", "use_wandb"), honoured("the wandb tracker joins logging.trackers, in this project",
                                                 reader=layout.wandb))
_add(G, ("wandb_entity", "wandb_name", "wandb_run_id", "wandb_mode"), honoured("wandb.init's entity, name, id, mode"))
_add(G, ("wandb_watch", "wandb_log_model"), noted("gradients are not watched and models not uploaded to wandb"))
_add(G, "use_tensorboard", honoured("the tensorboard tracker joins logging.trackers", reader=layout.tensorboard))
_add(G, ("use_mlflow", "mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name", "use_comet",
         "comet_project_name", "comet_api_key", "use_otel_metrics"), noted(_TRACKER))

G = "meshkit's own"
_add(G, ("generation_samples", "generation_max_new_tokens"),
     honoured("greedy answers to the first validation prompts in the summary (0 = none)"))
_add(G, "meshkit", honoured("a block of meshkit keys (top-level meshkit keys work too)", None))
# fmt: on

_RULES.extend(FURTHER_RULES)  # (the keys of features meshkit runs otherwise, or not at all)
_RULES.extend(PLUGIN_RULES)  # (the keys Axolotl's plugins add)
AXOLOTL_KEYS: Mapping[str, KeyRule] = {name: rule for _, names, rule in _RULES for name in names}


def is_empty(value: Any) -> bool:
    """Axolotl's configs leave keys empty to mean unset."""
    return value is None or value == "" or value == [] or value == {}


def is_off(value: Any) -> bool:
    return is_empty(value) or value in (False, 0, "false", "False", "none", "None")


def render_table() -> str:
    """The key table of docs/fine-tuning.md: one row per rule, keys grouped as declared."""
    lines = ["| Axolotl keys | kind | meshkit |", "|---|---|---|"]
    group = None
    for rule_group, names, rule in _RULES:
        if rule_group != group:
            group = rule_group
            lines.append(f"| **{group}** | | |")
        keys = ", ".join(f"`{name}`" for name in names)
        lines.append(f"| {keys} | {rule.kind} | {rule.effect.replace('|', '/')} |")
    return "\n".join(lines)
