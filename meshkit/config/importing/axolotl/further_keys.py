"""The rest of Axolotl's config schema: keys of features meshkit runs another way (noted: one line, the run goes on)
or does not have (refused: one line naming what to do), and the few more it honours. With `keys` every field of
Axolotl's schema has a row (a test checks it against the schema's field names), top level and dataset entries."""

from __future__ import annotations

from typing import Any

from meshkit.config.importing.axolotl import layout
from meshkit.config.importing.axolotl.rules import KeyRule, Rules, add_rule, honoured, noted, refused

FURTHER_RULES: Rules = []


def _add(group: str, names: tuple[str, ...] | str, rule: KeyRule) -> None:
    add_rule(FURTHER_RULES, group, names, rule)


def _attention(implementation: str) -> Any:
    return lambda value: implementation if value in (True, "true", "True") else None


def _rope_scaling(name: str, value: Any, sink: layout.Sink) -> None:
    """Into overrides_of_model_config (an explicit overrides_of_model_config written beside it wins)."""
    sink.recipe.setdefault("overrides_of_model_config", {})["rope_scaling"] = value


def _selective(value: Any) -> Any:
    return "selective" if value in (True, "true", "True") else None


_SPEED = "a speed or memory option of a GPU kernel; the model's own modules run here (the same loss)"
_HOUSEKEEPING = "housekeeping of Axolotl's trainer; meshkit's loop has its own (no effect on the result)"

# fmt: off
G = "further model and tokenizer keys"
_add(G, "type_of_model", honoured("Axolotl's older name of model_type", "recipe.model_type"))
_add(G, "eager_attention", honoured("attn_implementation: eager", "recipe.attn_implementation", _attention("eager")))
_add(G, "flex_attention", honoured("attn_implementation: flex_attention", "recipe.attn_implementation",
                                   _attention("flex_attention")))
_add(G, "rope_scaling", honoured("into overrides_of_model_config (rope_scaling)", reader=_rope_scaling))
_add(G, "chat_template_kwargs", honoured("arguments of the chat template (e.g. enable_thinking: false)"))
_add(G, ("flash_attn_d512", "flash_optimum", "fused_attn_kernel", "sage_attention", "sdpa_varlen", "lora_mlp_kernel",
         "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel", "use_kernels", "experts_implementation",
         "large_head_attention", "gemma4_hybrid_attn_impl", "flex_attn_compile_kwargs", "scaling_softmax",
         "scaling_softmax_factor", "scaling_softmax_bias", "llama4_linearized_experts", "use_onebitllms",
         "deepcompile", "torch_compile_options", "fp8_enable_fsdp_float8_all_gather",
         "embeddings_skip_upcast", "fp32_norms", "fp32_norm_classes", "float32"), noted(_SPEED))
_add(G, "tiled_mlp", honoured("`tiled_mlp`: each block's MLP over slices of the sequence under checkpointing (its "
                              "intermediate activations one slice at a time), in every layout", "tiled_mlp"))
_add(G, "tiled_mlp_num_shards",
     honoured("`tiled_mlp_shards` (unset: ceil(seq / max(hidden, 1024)))", "tiled_mlp_shards"))
_add(G, "tiled_mlp_use_original_mlp", noted("meshkit tiles the model's own MLP modules (its original MLP) always"))
_add(G, "chunked_cross_entropy_num_chunks",
     noted("meshkit's fused loss sizes its chunks by memory (64 MiB of logits at a time, at least as many tokens as "
           "the hidden size)"))
_add(G, ("device", "device_map", "model_kwargs", "overrides_of_model_kwargs", "cls_model_config",
         "experimental_skip_move_to_device", "qlora_sharded_model_loading", "torchdistx_path", "quantize_moe_experts",
         "peft_autocast_adapter_dtype", "peft_ensure_weight_tying", "tokenizer_save_jinja_files",
         "mean_resizing_embeddings", "shrink_embeddings", "freeze_mm_modules"),
     noted("loading details: meshkit places each weight for the layout, new embedding rows start at the mean"))
_add(G, ("model_quantization_config", "model_quantization_config_kwargs"),
     honoured("Mxfp4Config: a base released in MXFP4 (gpt-oss) loads dequantized, as it streams in (MXFP4 does not "
              "train; meshkit does so with or without the key); FineGrainedFP8Config is refused (use the bf16 "
              "release)"))
_add(G, "reinit_weights", honoured("the model starts from its own random initialisation (seeded, the same in every "
                                   "layout) instead of the checkpoint's weights"))
_add(G, "added_tokens_overrides", honoured("reserved added tokens renamed ({id: string}), their ids and embedding rows "
                                          "kept; an id that is not an added token is one line"))
_add(G, "fix_untrained_tokens", honoured("rows never trained (≤ 1e-16 in embedding and head) of tokens the data "
                                        "uses start at the mean of the trained rows, scaled by frequency; a list: "
                                        "those token ids (supervised runs; not with streamed data)"))
_add(G, "processor_kwargs", noted("a multimodal processor's arguments: text batches go through the tokenizer alone"))
_add(G, "tokenizer_use_mistral_common", honoured("Mistral's own tokenizer (tekken.json) through mistral-common, which "
                                                 "encodes each conversation itself (fine-tuning mode; the answers of "
                                                 "assistant turns train)"))

G = "further adapter keys"
_add(G, ("lora_rank_pattern", "lora_alpha_pattern", "peft_layers_pattern"),
     honoured("peft's rank_pattern / alpha_pattern (another rank or alpha for the layers a regex names) and "
              "layers_pattern (the block list peft_layers_to_transform counts in)"))
_add(G, "peft_trainable_token_indices",
     refused("not supported yet: train the embedding rows of new tokens with lora_modules_to_save: [embed_tokens]"))
_add(G, "relora_cpu_offload", noted("ReLoRA merges where the weights are, one layer at a time"))

G = "further data keys"
_add(G, ("dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor", "dataloader_drop_last",
         "shuffle_before_merging_datasets", "sample_packing_eff_est", "sample_packing_mp_start_method",
         "max_packed_sequence_len", "pad_to_multiple_of", "pretraining_sample_concatenation", "total_num_tokens",
         "total_supervised_tokens", "is_preprocess", "preprocess_iterable", "num_dataset_shards_to_save",
         "eval_sequence_len", "min_sample_len", "excess_length_strategy"),
     noted("data loading details: meshkit reads tokenized rows in the training process, packs first-fit, drops "
           "samples longer than sequence_len and evaluates at sequence_len"))
_add(G, ("dataset_shard_num", "dataset_shard_idx"),
     honoured("train on shard idx of num of the merged training records (datasets' contiguous shard), as Axolotl"))
_add(G, "dataset_exact_deduplication",
     honoured("tokenized samples (preference records) that repeat another exactly are dropped before the "
              "validation split, and counted"))
_add(G, "curriculum_sampling", honoured("batches take the training samples in their order (no shuffle)"))
_add(G, "role_boundaries",
     refused("not supported: role boundaries of a custom template; give the template as chat_template: jinja"))
_add(G, ("use_pose", "pose_max_context_len", "pose_num_chunks", "pose_split_on_token_ids"),
     refused("PoSE position skipping is not supported: remove the pose keys"))

G = "further training keys"
_add(G, ("gc_steps", "gc_collect_steps", "torch_empty_cache_steps", "profiler_steps", "profiler_steps_start",
         "include_tkps", "auto_find_batch_size", "world_size", "ddp", "accelerator_config", "axolotl_config_path",
         "fsdp_final_state_dict_type", "layer_offloading"), noted(_HOUSEKEEPING))
_add(G, "selective_checkpointing", honoured("`activation_checkpointing.mode: selective`",
                                            "activation_checkpointing.mode", _selective))
_add(G, "batch_size", honoured("Axolotl's older batch key: gradient_accumulation_steps = batch_size // "
                               "micro_batch_size, unless gradient_accumulation_steps is set"))
_add(G, ("adam_beta3", "adam_epsilon2"), noted("parameters of the CAME optimizer, which meshkit does not run"))
_add(G, ("cosine_constant_lr_ratio", "lr_div_factor"),
     honoured("cosine with cosine_min_lr_ratio: the floor reached at that share of the steps, then held; one_cycle's "
              "starting divisor"))
_add(G, ("embedding_lr", "embedding_lr_scale", "lr_groups"),
     honoured("Axolotl's param groups: the embedding and head at embedding_lr (or embedding_lr_scale × lr) without "
              "weight decay; lr_groups' matrices (names holding one of a group's modules) at the group's lr"))
_add(G, ("jagged_restart_steps", "jagged_restart_warmup_steps", "jagged_restart_anneal_steps"),
     honoured("the schedule times Axolotl's jagged-restart factor: every jagged_restart_steps the lr falls to a floor "
              "(cosine_min_lr_ratio, else 0.001) and warms up again over the warm-up steps (10), annealed over the "
              "anneal steps (1) before; not with one_cycle"))
_add(G, ("dion_lr", "dion_momentum", "dion_rank_fraction", "dion_rank_multiple_of", "qgalore_rank",
         "qgalore_update_proj_gap", "qgalore_scale", "qgalore_proj_type", "qgalore_proj_quant", "qgalore_proj_bits",
         "qgalore_proj_group_size", "qgalore_cos_threshold", "qgalore_gamma_proj", "qgalore_queue_size"),
     refused("the Dion and Q-GaLore optimizers are not supported: choose another optimizer"))
_add(G, ("lisa_n_layers", "lisa_step_interval", "lisa_layers_attribute"),
     honoured("LISA: a full fine-tune training lisa_n_layers random blocks at a time (embeddings, norm and head "
              "throughout), drawn anew every lisa_step_interval steps, the others' gradients dropped before each "
              "update (as if frozen), in every layout but ZeRO-1/2"))
_add(G, ("use_eaft", "eaft_alpha", "eaft_k"),
     honoured("EAFT: each token's training loss times (entropy of its top eaft_k next-token probabilities) ** "
              "eaft_alpha, in every layout (tp: the top k gathered over the vocabulary's shards); supervised runs"))
_add(G, "dpo_norm_loss", refused("no longer an Axolotl key (it refuses it too): remove it"))
_add(G, "ebft", refused("EBFT (rl: ebft) is online RL with generated rollouts, which meshkit does not run: train "
                        "offline preference data with rl: dpo, ipo, kto, orpo or simpo"))
_add(G, "qat", honoured("quantization-aware training through torchao (Axolotl's combinations: int4 weights alone or "
                        "with int8/float8 activations, float8, mxfp4, nvfp4 — its matmul on Blackwell GPUs, elsewhere "
                        "the rounded values multiplied in the layer's dtype), full fine-tune in "
                        "every layout but tp; merged/ holds the full-precision weights"))
_add(G, "quantization", noted("read by `axolotl quantize` (post-training quantization of the exported model), not by "
                              "training: quantize merged/ with torchao's quantize_"))
_add(G, ("trainer_cls", "dynamic_checkpoint"),
     refused("meshkit runs its own loop: checkpoints follow save_steps and preemption signals; remove the key"))

G = "further evaluation and output keys"
_add(G, ("generate_samples", "num_generation_samples", "generation_do_sample", "generation_temperature",
         "generation_top_k", "generation_top_p", "generation_prompt_ratio"),
     noted("the summary holds greedy answers to generation_samples validation prompts"))
_add(G, ("load_best_model_at_end", "metric_for_best_model", "greater_is_better"),
     noted("the last model is exported; every checkpoint kept holds its own (early_stopping_patience stops)"))
_add(G, ("do_bench_eval", "bench_dataset", "bench_split"), refused("benchmark evaluation is not supported: "
                                                                   "evaluate merged/ with your evaluation harness"))
_add(G, ("gradio_title", "gradio_share", "gradio_server_name", "gradio_server_port", "gradio_max_new_tokens",
         "gradio_temperature"), noted("no web demo here: merged/ loads with from_pretrained"))
_add(G, ("hub_revision", "vllm"), noted("no hub upload and no vLLM server here: the outputs stay in output_dir"))
_add(G, ("use_trackio", "trackio_project_name", "trackio_run_name", "trackio_space_id", "comet_workspace",
         "comet_experiment_key", "comet_mode", "comet_online", "comet_experiment_config", "otel_metrics_host",
         "otel_metrics_port", "hf_mlflow_log_artifacts"),
     noted("metrics go to jsonl, and to tensorboard / wandb when asked; this tracker is not one of them"))
# fmt: on

G = "keys Axolotl's own examples write that its current schema no longer reads"
_add(
    G,
    ("gptq_groupsize", "gptq_model_v1", "gptq_disable_exllama", "base_model_ignore_patterns"),
    noted("an older Axolotl key (before its transformers-native GPTQ) that Axolotl no longer reads: no effect"),
)
_add(
    G, "adam_eps", noted("Axolotl's older name of adam_epsilon, which it no longer reads: no effect (set adam_epsilon)")
)
_add(
    G,
    "eta_min",
    noted("not read by Axolotl (its examples set it): no effect; cosine_min_lr_ratio sets the cosine schedule's floor"),
)
_add(G, "test_value", noted("not read by Axolotl (one of its examples sets it): no effect"))

# Keys of a dataset entry that DatasetEntry does not hold: noted (dropped with a notice) or refused
DATASET_KEY_RULES: dict[str, KeyRule] = {
    **dict.fromkeys(
        ("conversation", "input_format", "input_transform", "trust_remote_code", "preprocess_shards",
         "max_completion_length", "step_separator", "train_on_last_step_only"),  # (stepwise_supervised's own: read)
        noted("no effect here: the entry's type and fields say how records become tokens"),
    ),
    **dict.fromkeys(
        ("field_human", "field_model"),
        noted("no effect: Axolotl reads them nowhere (chat turns are mapped by message_property_mappings)"),
    ),
    **dict.fromkeys(
        ("logprobs_field", "temperature"),
        refused("a knowledge-distillation dataset (Axolotl's KD plugin) is not supported: train on the teacher's "
                "completions as chat_template data instead"),
    ),
}  # fmt: skip
