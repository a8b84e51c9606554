"""Keys of Axolotl's plugins (`src/axolotl/integrations/*/args.py`): a config that lists a plugin writes its keys
at the top level. Kernel and tracker plugins are noted (the run goes on without them); plugins that train another
way (diffusion, distillation, ...) are refused in one line naming the feature. The names are facts of Axolotl's
plugins; the ones that are also core keys (cut_cross_entropy, liger_*, expert_parallel_size) have their rows in
`keys`."""

from __future__ import annotations

from meshkit.config.importing.axolotl.rules import KeyRule, Rules, add_rule, noted, refused

PLUGIN_RULES: Rules = []


def _add(group: str, names: tuple[str, ...] | str, rule: KeyRule) -> None:
    add_rule(PLUGIN_RULES, group, names, rule)


G = "Axolotl plugins' keys"
# fmt: off
_add(G, ("expert_backend", "nonexpert_quantization", "moe_grouped_backend", "moe_dequant_chunk_size", "moe_bnb_fast",
         "use_scattermoe", "use_sonicmoe", "use_dsv4_kernels", "use_glm_dsa_kernels", "dsv4_fp8_nonexpert_mode",
         "dsv4_fp8_lora_kernel", "dsv4_shared_mlp_lora_kernel", "dsv4_bf16_all", "dsv4_fp4_grouped_mode",
         "gemma4_fp8_nonexpert", "gemma4_nf4_nonexpert", "nvfp4_merge_aware", "nvfp4_merge_aware_start_step",
         "dense_mixer"),
     noted("GPU kernels of Axolotl's kernels plugins (MoE grouped GEMMs, low-precision experts): meshkit computes "
           "the experts with its own layout"))
_add(G, ("liger_rms_norm_gated", "liger_swiglu", "liger_cross_entropy", "liger_use_token_scaling"),
     noted("Liger's GPU kernels: the plain torch path runs here"))
_add(G, ("expert_parallel_backend", "expert_parallel_num_nvl_bytes", "expert_parallel_num_rdma_bytes",
         "expert_parallel_token_capacity", "expert_parallel_fallback_on_unsupported"),
     noted("DeepEP's buffers and backend: meshkit's expert parallel sends tokens with torch's all-to-all"))
_add(G, ("use_swanlab", "swanlab_project", "swanlab_experiment_name", "swanlab_description", "swanlab_mode",
         "swanlab_workspace", "swanlab_api_key", "swanlab_log_model", "swanlab_web_host", "swanlab_api_host",
         "swanlab_lark_webhook_url", "swanlab_lark_secret", "swanlab_log_completions",
         "swanlab_completion_log_interval", "swanlab_completion_max_buffer"),
     noted("metrics go to jsonl, and to tensorboard / wandb when asked; SwanLab is not one of them"))
_add(G, ("diffusion", "noise_schedule", "min_mask_ratio", "max_mask_ratio", "num_diffusion_steps",
         "importance_weighting", "mask_token_id", "mask_token_str", "generation_interval", "num_generation_samples",
         "generation_steps", "generation_temperature", "generation_max_length"),
     refused("diffusion language-model training is not supported: train the causal LM (remove the diffusion keys)"))
_add(G, ("kd_trainer", "kd_ce_alpha", "kd_alpha", "kd_temperature", "kd_beta", "kd_normalize_topk",
         "kd_online_server_base_url", "kd_online_topk", "kd_online_server", "kd_online_timeout", "kd_temperature_min"),
     refused("knowledge distillation is not supported: fine-tune on the teacher's outputs as data instead"))
_add(G, ("llmcompressor", "save_compressed"),
     refused("sparse fine-tuning through llm-compressor is not supported: compress the exported merged/ model"))
_add(G, ("lm_eval_tasks", "lm_eval_batch_size", "lm_eval_post_train", "lm_eval_model"),
     refused("benchmark evaluation is not supported: evaluate merged/ with your evaluation harness"))
_add(G, ("grokfast_alpha", "grokfast_lamb", "spectrum_top_fraction", "spectrum_model_name", "use_mora", "mora_type",
         "mora"),
     refused("not supported (Grokfast gradients, Spectrum layer selection, MoRA): remove the key; "
             "unfrozen_parameters selects layers to train"))
_add(G, ("nemo_gym_enabled", "nemo_gym_dir", "nemo_gym_auto_clone", "nemo_gym_config_paths", "nemo_gym_head_port",
         "nemo_gym_server_timeout", "nemo_gym_verify_timeout", "nemo_gym_run_timeout", "nemo_gym_datasets",
         "nemo_gym_auto_start", "nemo_gym_model_name", "nemo_gym_multi_turn", "nemo_gym_max_turns"),
     refused("online RL environments (NeMo Gym) are not run: meshkit trains on prepared data"))
# fmt: on
