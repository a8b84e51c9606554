"""Axolotl configs as written: the key table (and the fine-tuning page's copy of it), configs in the shape of Axolotl's
examples resolved key by key, the dataset keys, and such configs trained in real gloo worlds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from meshkit.config.importing.axolotl.keys import AXOLOTL_KEYS, render_table  # noqa: E402
from meshkit.config.resolve import ConfigError, leaf_keys  # noqa: E402
from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.tokenized import load_samples  # noqa: E402
from meshkit.recipes.finetune_config import resolve_finetune  # noqa: E402
from meshkit.recipes.finetune_settings import FinetuneSettings  # noqa: E402
from meshkit.training.loss import IGNORE_INDEX  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import run_finetune, write_jsonl  # noqa: E402

FINE_TUNING_PAGE = (Path(__file__).resolve().parents[2] / "docs" / "fine-tuning.md").read_text()
TIMEOUT = 240


def axolotl_lora(material, out: Path, **keys) -> dict:
    """The shape of Axolotl's examples/llama-3/instruct-lora-8b.yml: every key as that file writes it, empty ones
    included, with base_model and the dataset pointed at local copies."""
    config = {
        "base_model": str(material["base"]), "model_type": "LlamaForCausalLM", "tokenizer_type": "AutoTokenizer",
        "load_in_8bit": False, "load_in_4bit": False, "strict": False, "chat_template": "chatml",
        "datasets": [{"path": str(material["chat"]), "type": "chat_template", "field_messages": "messages",
                      "message_field_role": "role", "message_field_content": "content",
                      "roles": {"user": ["user"], "assistant": ["assistant"]}}],
        "dataset_prepared_path": None, "val_set_size": 4, "output_dir": str(out),
        "sequence_len": 128, "sample_packing": False, "pad_to_sequence_len": True,
        "adapter": "lora", "lora_model_dir": None, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "lora_target_linear": True, "lora_fan_in_fan_out": None,
        "wandb_project": None, "wandb_entity": None, "wandb_watch": None, "wandb_name": None, "wandb_log_model": None,
        "gradient_accumulation_steps": 1, "micro_batch_size": 2, "max_steps": 4, "optimizer": "adamw_bnb_8bit",
        "lr_scheduler": "constant_with_warmup", "learning_rate": 0.01, "train_on_inputs": False,
        "group_by_length": False, "bf16": "auto", "fp16": None, "tf32": False, "gradient_checkpointing": True,
        "early_stopping_patience": None, "resume_from_checkpoint": None, "local_rank": None, "logging_steps": 1,
        "xformers_attention": None, "flash_attention": True, "s2_attention": None, "warmup_ratio": 0.25,
        "evals_per_epoch": 4, "eval_table_size": None, "eval_max_new_tokens": 16, "saves_per_epoch": 1,
        "debug": None, "deepspeed": None, "weight_decay": 0.0, "fsdp": None, "fsdp_config": None,
        "special_tokens": {"pad_token": "</s>"}, "loss_watchdog_threshold": 50.0, "loss_watchdog_patience": 3,
        "generation_samples": 0,
    }  # fmt: skip
    return {**config, **keys}


def _trained(tokenizer, sample) -> str:
    return tokenizer.decode(
        [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
    )


def _write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ------------------------------------------------------------------ the table
def test_the_fine_tuning_page_holds_the_key_table_as_rendered() -> None:
    assert render_table() in FINE_TUNING_PAGE, (
        "docs/fine-tuning.md key table differs: paste meshkit.config.importing.axolotl.keys.render_table()"
    )


def test_every_recipe_setting_and_meshkit_target_is_in_the_table() -> None:
    reached = {name for name, rule in AXOLOTL_KEYS.items() if rule.to == "recipe"}
    reached |= {r.to.removeprefix("recipe.") for r in AXOLOTL_KEYS.values() if (r.to or "").startswith("recipe.")}
    reached |= {"wandb_project", "special_tokens", "tokens"}  # set by the wandb and the tokens readers
    assert set(FinetuneSettings.model_fields) <= reached, set(FinetuneSettings.model_fields) - reached
    targets = {rule.to for rule in AXOLOTL_KEYS.values() if rule.to and not rule.to.startswith("recipe")}
    assert targets <= set(leaf_keys()), targets - set(leaf_keys())
    assert {rule.kind for rule in AXOLOTL_KEYS.values()} == {"honoured", "noted", "refused"}


# ------------------------------------------------------------------ configs resolved as written
def test_an_axolotl_lora_example_resolves_as_written(tmp_path, material) -> None:
    job = resolve_finetune(_write(tmp_path / "lora.yml", axolotl_lora(material, tmp_path / "out")), [], env={})
    s, cfg = job.settings, job.resolved.config
    assert (s.adapter, s.lora_r, s.optimizer) == ("lora", 4, "adamw_bnb_8bit")
    assert (s.warmup_ratio, s.evals_per_epoch) == (0.25, 4)
    assert s.attn_implementation == "flash_attention_2" and s.special_tokens == {"pad_token": "</s>"}
    assert s.generation_max_new_tokens == 16 and s.pad_to_sequence_len and s.chat_template == "chatml"
    assert cfg.activation_checkpointing.mode == "full" and cfg.precision == "no"  # bf16: auto on a CPU: fp32
    assert job.resolved.sources["activation_checkpointing.mode"].endswith("(gradient_checkpointing)")
    assert job.notes == ()  # every key it sets is honoured; the empty ones mean unset


def test_deepspeed_fsdp_and_the_parallel_size_keys_land_on_the_layout(tmp_path, material) -> None:
    ds = tmp_path / "zero2.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}, "train_batch_size": "auto"}))
    job = resolve_finetune(_write(tmp_path / "a.yml", axolotl_lora(material, tmp_path, deepspeed=str(ds))), [], env={})
    assert job.resolved.config.sharding.zero_stage == 2
    assert "zero2.json" in job.resolved.sources["sharding.zero_stage"]
    assert any("overlap_comm" in note for note in job.notes) and len(job.notes) == 1

    stock = axolotl_lora(material, tmp_path, deepspeed="deepspeed_configs/zero3_bf16.json", adapter=None)
    job = resolve_finetune(_write(tmp_path / "b.yml", stock), [], env={})
    assert job.resolved.config.sharding.zero_stage == 3 and job.resolved.config.precision == "bf16"
    assert any("stock zero3_bf16.json" in note for note in job.notes)

    fsdp = axolotl_lora(
        material, tmp_path, adapter=None, fsdp=["full_shard", "auto_wrap"], fsdp_version=2, dp_shard_size=2,
        tensor_parallel_size=2, context_parallel_size=1, dp_replicate_size=1,
        fsdp_config={"offload_params": False, "state_dict_type": "FULL_STATE_DICT", "reshard_after_forward": True,
                     "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                     "transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    )  # fmt: skip
    cfg = resolve_finetune(_write(tmp_path / "c.yml", fsdp), [], env={}).resolved.config
    assert (cfg.sharding.zero_stage, cfg.sharding.reshard_after_forward) == (3, True)
    assert (cfg.parallel.dp_shard, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.dp_replicate) == (2, 2, 1, 1)

    # Axolotl's expert-parallel examples (Qwen3-30B-A3B): expert_parallel_size is parallel.ep
    moe = axolotl_lora(material, tmp_path, adapter=None, fsdp_version=2, dp_shard_size=4, expert_parallel_size=4)
    job = resolve_finetune(_write(tmp_path / "e.yml", moe), [], env={})
    assert (job.resolved.config.parallel.ep, job.resolved.config.parallel.dp_shard) == (4, 4)
    assert "e.yml" in job.resolved.sources["parallel.ep"] and not job.notes


def test_trackers_and_schedules_by_their_axolotl_names(tmp_path, material) -> None:
    keys = axolotl_lora(material, tmp_path, wandb_project="ft", wandb_mode="offline", use_tensorboard=True,
                        lr_scheduler="cosine", cosine_min_lr_ratio=0.1)  # fmt: skip
    job = resolve_finetune(_write(tmp_path / "t.yml", keys), [], env={})
    assert job.resolved.config.logging.trackers == ("jsonl", "wandb", "tensorboard")
    assert job.settings.wandb_project == "ft" and job.settings.wandb_mode == "offline"


def test_axolotls_ray_keys_choose_the_ray_launch_backend(tmp_path, material) -> None:
    keys = axolotl_lora(material, tmp_path, use_ray=True, ray_num_workers=2, ray_run_name="sft",
                        resources_per_worker={"GPU": 0, "CPU": 2, "accelerator_type:A100": 1})  # fmt: skip
    job = resolve_finetune(_write(tmp_path / "r.yml", keys), [], env={})
    launch, sources = job.resolved.config.launch, job.resolved.sources
    assert (launch.backend, launch.ray_num_workers, launch.world_size) == ("ray", 2, 2)
    assert (launch.ray_cpus_per_worker, launch.ray_gpus_per_worker) == (2.0, 0.0)
    assert sources["launch.backend"].endswith("(use_ray)")
    assert sources["launch.ray_cpus_per_worker"].endswith("(resources_per_worker.CPU)")
    assert len(job.notes) == 2 and any("accelerator_type:A100" in note for note in job.notes)
    assert any(note.startswith("ray_run_name") for note in job.notes)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"warmup_steps": 3}, "set warmup_ratio or warmup_steps, not both"),
        ({"save_steps": 3}, "set saves_per_epoch or save_steps, not both"),
        ({"lora_dropuot": 0.1}, "unknown key 'lora_dropuot'.*did you mean 'lora_dropout'"),
        ({"optimizer": "adamw_apex_fused"}, "not an optimizer meshkit runs; choose one of adamw_torch"),
        ({"lr_scheduler": "rex"}, "not a schedule meshkit runs"),
        ({"load_in_4bit": True, "load_in_8bit": True}, "two quantizations: keep one"),
        ({"peft_use_dora": True, "load_in_4bit": True}, "DoRA over a quantized base is not supported yet"),
        ({"processor_type": "AutoProcessor"}, "processor_type: 'AutoProcessor' .*multimodal processors"),
        ({"rl": "grpo"}, "rl: grpo is online RL .* train offline preference data with dpo, ipo, kto, orpo or simpo"),
        ({"rl": "ebft"}, "rl: ebft is online RL"),
        ({"rl": "xpo"}, "'rl'.*'dpo', 'ipo', 'kto', 'orpo' or 'simpo'"),
        ({"lisa_n_layers": 2}, "LISA needs lisa_n_layers .* and lisa_step_interval"),
        ({"relora": True}, "relora: true merges and restarts the adapters every jagged_restart_steps: set it"),
        ({"jagged_restart_steps": 5, "lr_scheduler": "one_cycle"}, "one_cycle is not such a schedule"),
        ({"process_reward_model": True}, "a process reward model reads type: stepwise_supervised datasets"),
        ({"reward_model": True, "rl": "dpo"}, "reward_model: true trains a sequence-classification model .* drop rl"),
        ({"rl": "dpo", "sample_packing": True}, "rl: dpo runs unpacked rows"),
        ({"fsdp": ["full_shard", "sharded_everything"]}, "'sharded_everything' is not an FSDP option"),
    ],
)
def test_what_cannot_run_is_one_line(tmp_path, material, keys, expected) -> None:
    path = _write(tmp_path / "x.yml", axolotl_lora(material, tmp_path, **keys))
    with pytest.raises(ConfigError, match=expected) as caught:
        resolve_finetune(path, [], env={})
    assert "\n" not in str(caught.value)


def test_noted_keys_are_one_line_each_and_the_run_goes_on(tmp_path, material) -> None:
    keys = axolotl_lora(material, tmp_path, hub_model_id="me/model", eval_sample_packing=True, xformers_attention=True)
    notes = resolve_finetune(_write(tmp_path / "n.yml", keys), [], env={}).notes
    assert len(notes) == 3 and all("\n" not in note and "no effect here" in note for note in notes)


# ------------------------------------------------------------------ dataset keys
def test_sharegpt_style_records_with_mappings_roles_and_eos(tmp_path, tokenizer) -> None:
    turns = [("system", "Be brief."), ("human", "Shout apple"), ("gpt", "APPLE"), ("human", "again"), ("gpt", "APPLE")]
    data = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": [{"from": r, "value": v} for r, v in turns]}])
    mappings = {"role": "from", "content": "value"}
    entry = DatasetEntry(
        path=data,
        type="chat_template",
        field_messages="conversations",
        message_property_mappings=mappings,
        chat_template="llama3",
    )
    (sample,), _ = load_samples([entry], tokenizer, sequence_len=512, train_on_inputs=False)
    trained = _trained(tokenizer, sample)
    assert (
        trained.count("APPLE") == 2
        and "again" not in trained
        and "<|start_header_id|>" in tokenizer.decode(sample.input_ids)
    )
    no_system = DatasetEntry(**{**entry.model_dump(), "drop_system_message": True, "roles_to_train": ["user"]})
    (other,), _ = load_samples([no_system], tokenizer, sequence_len=512, train_on_inputs=False)
    trained = _trained(tokenizer, other)
    assert "Be brief" not in tokenizer.decode(other.input_ids) and "again" in trained and "APPLE" not in trained


def test_alpaca_variants_completion_field_input_output_and_custom_types(tmp_path, tokenizer) -> None:
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Add 1 and 2.", "input": "", "output": "3"}])
    texts = write_jsonl(tmp_path / "c.jsonl", [{"body": "the apple is here"}])
    segments = write_jsonl(tmp_path / "s.jsonl", [{"segments": [{"text": "Q: a", "label": False},
                                                                {"text": " A: b", "label": True}]}])  # fmt: skip
    custom = {"field_instruction": "q", "field_output": "a", "no_input_format": "[{instruction}]"}
    qa = write_jsonl(tmp_path / "q.jsonl", [{"q": "apple", "a": "river"}])
    entries = [
        DatasetEntry(path=alpaca, type="alpaca:phi"),
        DatasetEntry(path=texts, type="completion", field="body"),
        DatasetEntry(path=segments, type="input_output"),
        DatasetEntry(path=qa, type=custom),
    ]
    phi, body, io, q = load_samples(entries, tokenizer, sequence_len=512, train_on_inputs=False)[0]
    assert "<|user|>" in tokenizer.decode(phi.input_ids)
    assert _trained(tokenizer, body).startswith("the apple")
    assert _trained(tokenizer, io) == " A: b"
    assert "[apple]" in tokenizer.decode(q.input_ids)
    with pytest.raises(ValueError, match="has no split 'test' \\(it has train\\)"):
        load_samples(
            [DatasetEntry(path=alpaca, type="alpaca", split="test")], tokenizer, sequence_len=64, train_on_inputs=False
        )


# ------------------------------------------------------------------ trained as written
def _train(tmp_path: Path, material, world: int, name: str, **keys) -> dict:
    out = tmp_path / name
    out.mkdir()
    config = _write(out / "axolotl.yml", axolotl_lora(material, out / "out", **keys))
    return run_world(run_finetune, world, str(config), [f"output_dir={out / 'out'}"], timeout=TIMEOUT)[0]


def _close(got: list[float], expected: list[float], rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=rtol, atol=0)


def test_an_axolotl_lora_config_trains_as_written_and_two_ranks_equal_one(tmp_path, material) -> None:
    # 8-bit Adam: tensors under 4096 elements keep 32-bit states, so the LoRA adapters here train exactly
    one = _train(tmp_path, material, 1, "one", micro_batch_size=4)
    two = _train(tmp_path, material, 2, "two")
    _close(two["losses"], one["losses"], 1e-5)
    _close([e["eval_loss"] for e in two["evals"]], [e["eval_loss"] for e in one["evals"]], 1e-5)
    assert len(one["evals"]) == 4 and one["losses"][-1] < one["losses"][0]  # evals_per_epoch: 4


@pytest.mark.parametrize(
    "layout", [{"deepspeed": "zero1.json", "optimizer": "adamw_torch"}, {"fsdp": ["full_shard"]}, {}]
)
def test_full_fine_tunes_from_deepspeed_and_fsdp_keys_equal_one_process(tmp_path, material, layout) -> None:
    # {}: DDP with bitsandbytes' 8-bit AdamW (8-bit states for the embedding and head), saved per saves_per_epoch
    layout = layout or {"optimizer": "adamw_8bit"}
    keys = {"adapter": None, "lora_r": None, "lora_alpha": None, "lora_target_linear": None, "learning_rate": 1e-3,
            "optimizer": "adamw_torch", **layout}  # fmt: skip
    single = {k: v for k, v in keys.items() if k not in ("deepspeed", "fsdp")}
    one = _train(tmp_path, material, 1, "one", micro_batch_size=4, **single)
    two = _train(tmp_path, material, 2, "two", **keys)
    _close(two["losses"], one["losses"], 1e-4)  # full fine-tune: reduction order differs at 1e-5


def test_rslora_and_layers_to_transform_reach_peft(tmp_path, material) -> None:
    from transformers import AutoModelForCausalLM

    from meshkit.tuning.lora import apply_lora

    keys = axolotl_lora(material, tmp_path, peft_use_rslora=True, peft_layers_to_transform=[1], lora_target_linear=None,
                        lora_target_modules=["q_proj"])  # fmt: skip
    settings = resolve_finetune(_write(tmp_path / "r.yml", keys), [], env={}).settings
    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(material["base"]), settings)
    adapted = [name for name, _ in peft_model.named_parameters() if "lora_A" in name]
    assert adapted == ["base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight"]
    assert peft_model.base_model.model.model.layers[1].self_attn.q_proj.scaling["default"] == 8 / 4**0.5


AXOLOTL_PARALLEL = {  # Axolotl's distributed-parallel examples: their size keys, at world 4 (and 8)
    "fsdp_x_tp": {"dp_shard_size": 2, "tensor_parallel_size": 2},
    "fsdp_x_cp": {"dp_shard_size": 2, "context_parallel_size": 2},
}


@pytest.mark.slow
def test_axolotl_parallel_size_keys_train_at_world_four_as_one_process(tmp_path, material) -> None:
    keys = {"optimizer": "adamw_torch", "evals_per_epoch": None, "saves_per_epoch": None}
    one = _train(tmp_path, material, 1, "one", micro_batch_size=4, **keys)  # dp 2 in each layout below
    for name, sizes in AXOLOTL_PARALLEL.items():
        got = _train(tmp_path, material, 4, name, **keys, **sizes)
        expected = {
            "dp_shard": 2,
            "tp": sizes.get("tensor_parallel_size", 1),
            "cp": sizes.get("context_parallel_size", 1),
        }
        assert {key: got["layout"].get(key, 1) for key in expected} == expected
        _close(got["losses"], one["losses"], 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "dp"),
    [  # (world 8: in `make test-full`; the suite runs Axolotl's size keys at world 4 above)
        pytest.param(
            {"dp_replicate_size": 2, "dp_shard_size": 2, "tensor_parallel_size": 2}, 4, marks=pytest.mark.sweep
        ),
        pytest.param(
            {"dp_shard_size": 2, "tensor_parallel_size": 2, "context_parallel_size": 2}, 2, marks=pytest.mark.sweep
        ),
    ],
    ids=["hsdp_x_tp", "fsdp_x_tp_x_cp"],
)
def test_axolotl_parallel_sizes_train_at_world_eight_as_one_process(tmp_path, material, sizes, dp) -> None:
    keys = {"optimizer": "adamw_torch", "evals_per_epoch": None, "saves_per_epoch": None}
    one = _train(tmp_path, material, 1, "one", micro_batch_size=2 * dp, **keys)
    got = _train(tmp_path, material, 8, "eight", **keys, **sizes)
    _close(got["losses"], one["losses"], 1e-4)


def test_every_field_of_axolotls_schema_has_a_row() -> None:
    """Top-level keys: a row of the key table (honoured, noted or refused); dataset-entry keys: a field of meshkit's
    entry or a row of its own (noted or refused)."""
    from meshkit.config.importing.axolotl.further_keys import DATASET_KEY_RULES
    from meshkit.data.dataset_entry import CustomPrompt, DatasetEntry, PreferencePrompt
    from tests.config.axolotl_schema_fields import DATASET_ENTRY, TOP_LEVEL

    assert len(TOP_LEVEL) > 380 and len(DATASET_ENTRY) > 50
    assert [name for name in TOP_LEVEL if name not in AXOLOTL_KEYS] == []
    entry_fields = {*DatasetEntry.model_fields, *CustomPrompt.model_fields, *PreferencePrompt.model_fields}
    assert [name for name in DATASET_ENTRY if name not in entry_fields | set(DATASET_KEY_RULES)] == []


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"logprobs_field": "logprobs"}, "datasets\\[0\\].logprobs_field: 'logprobs' .* knowledge-distillation"),
        ({"conversation": "x"}, None),
    ],
)
def test_dataset_entry_keys_are_noted_or_refused_in_one_line(tmp_path, material, entry, expected) -> None:
    datasets = [{"path": str(material["alpaca"]), "type": "alpaca", **entry}]
    path = _write(tmp_path / "d.yml", axolotl_lora(material, tmp_path, datasets=datasets))
    if expected is None:
        job = resolve_finetune(path, [], env={})
        assert any("datasets[0].conversation" in note and "no effect here" in note for note in job.notes)
        return
    with pytest.raises(ConfigError, match=expected) as caught:
        resolve_finetune(path, [], env={})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("special_first", [True, False])
def test_tokens_as_a_mapping_is_axolotls_early_special_tokens(tmp_path, material, special_first) -> None:
    config = axolotl_lora(material, tmp_path)
    mapping = {"bos_token": "<s>", "pad_token": "<unk>"}
    if special_first:
        config["tokens"] = mapping  # (after special_tokens: {pad_token: </s>})
    else:
        config = {"tokens": mapping, **config}
    job = resolve_finetune(_write(tmp_path / "t.yml", config), [], env={})
    assert job.settings.special_tokens == {"bos_token": "<s>", "pad_token": "</s>"}  # special_tokens' own wins
    assert job.settings.tokens is None or not job.settings.tokens
    assert [note for note in job.notes if note.startswith("tokens: bos_token, pad_token is Axolotl's early")]
