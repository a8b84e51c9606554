"""The fine-tuning recipe's parts in one process: config keys, JSONL errors, label masking, packing."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from meshkit.config.resolve import ConfigError  # noqa: E402
from meshkit.data.jsonl import DataFormatError  # noqa: E402
from meshkit.data.packing import PackedSamples, PadCollate, PaddedSamples, pack  # noqa: E402
from meshkit.data.tokenized import load_samples  # noqa: E402
from meshkit.recipes.finetune_config import resolve_finetune  # noqa: E402
from meshkit.training.loss import IGNORE_INDEX, split_causal_lm_batch  # noqa: E402
from tests.helpers.cli import ROOT, meshkit  # noqa: E402
from tests.helpers.finetune_runs import write_config, write_jsonl  # noqa: E402
from tests.helpers.hf_models import causal_lm  # noqa: E402


def test_axolotl_keys_map_to_meshkit_keys_with_their_source(tmp_path, material) -> None:
    path = write_config(
        tmp_path / "ft.yaml", material, gradient_accumulation_steps=2, meshkit={"zero_stage": 3}, load_in_8bit=False
    )
    job = resolve_finetune(path, ["learning_rate=0.005", "lora_r=16", "tp=1"], env={})
    sources = job.resolved.sources
    assert job.resolved.config.train.lr == 0.005 and sources["train.lr"] == "argument learning_rate (learning_rate)"
    assert job.resolved.config.grad_accum_steps == 2 and "(gradient_accumulation_steps)" in sources["grad_accum_steps"]
    assert job.resolved.config.sharding.zero_stage == 3 and sources["sharding.zero_stage"] == f"file {path}"
    assert job.resolved.config.sharding.init_from == material["base"] / "model.safetensors"
    assert job.settings.lora_r == 16 and job.recipe_sources["lora_r"] == "argument lora_r"
    assert job.steps_given() and job.resolved.config.train.steps == 4
    assert not job.notes  # a refused key switched off asks for nothing: silent


def test_axolotls_older_batch_size_sets_the_accumulation_unless_it_is_given(tmp_path, material) -> None:
    path = write_config(tmp_path / "bs.yaml", material, batch_size=8, micro_batch_size=2)
    job = resolve_finetune(path, [], env={})
    assert job.resolved.config.grad_accum_steps == 4
    assert job.resolved.sources["grad_accum_steps"] == f"file {path} (batch_size 8 // micro_batch_size 2)"
    given = resolve_finetune(path, ["gradient_accumulation_steps=3"], env={})
    assert given.resolved.config.grad_accum_steps == 3  # as in Axolotl: gradient_accumulation_steps wins


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"learnin_rate": 0.1}, "unknown key 'learnin_rate'.*did you mean 'learning_rate'"),
        ({"processor_type": "AutoProcessor"}, "Axolotl key processor_type: 'AutoProcessor' .* is not supported"),
        ({"deepspeed": "ds.json"}, "deepspeed: ds.json: no such file"),
        ({"peft_layer_replication": [[0, 1]]}, "LoRA starts from peft's default initialisation"),
        ({"adapter": "ia3"}, "'adapter'"),
        ({"learning_rate": 0.1, "meshkit": {"train": {"lr": 0.2}}}, "'train.lr' is set twice"),
    ],
)
def test_unknown_and_unsupported_keys_are_one_line_errors(tmp_path, material, keys, expected) -> None:
    path = write_config(tmp_path / "ft.yaml", material, **keys)
    with pytest.raises(ConfigError, match=expected) as caught:
        resolve_finetune(path, [], env={})
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_malformed_jsonl_names_file_and_line_on_the_command_line(tmp_path, material) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    path = write_config(tmp_path / "ft.yaml", material, datasets=[{"path": str(data), "type": "alpaca"}])
    proc = meshkit("finetune", str(path))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and f"{data}:2: not valid JSON" in lines[0], proc.stderr


def test_a_strategy_other_than_auto_is_refused_on_the_command_line(tmp_path, material) -> None:
    path = write_config(tmp_path / "ft.yaml", material)
    proc = meshkit("finetune", str(path), "strategy=dataparallel")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "not strategy=dataparallel" in lines[0], proc.stderr


def test_evaluation_under_the_v_schedule_is_refused_before_training(tmp_path, material) -> None:
    path = write_config(tmp_path / "ft.yaml", material, val_set_size=4)
    proc = meshkit("finetune", str(path), "pp=2", "nproc_per_node=2", "schedule=zbv_zero_bubble")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "evaluation (val_set_size, test_datasets) runs" in line]
    assert len(lines) == 1 and "use schedule interleaved_zero_bubble" in lines[0], proc.stderr


def test_a_missing_field_names_the_record(tmp_path, tokenizer) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c"}])
    with pytest.raises(DataFormatError, match=r"d.jsonl:2: the record has no 'output' field"):
        load_samples([(data, "alpaca")], tokenizer, sequence_len=256, train_on_inputs=False)
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(DataFormatError, match=r"c.jsonl:1: messages\[0\]: the record has no 'content'"):
        load_samples([(chat, "chat_template")], tokenizer, sequence_len=256, train_on_inputs=False)


def _trained_text(tokenizer, sample) -> str:
    return tokenizer.decode(
        [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
    )


def test_prompt_tokens_are_masked_unless_train_on_inputs(material, tokenizer) -> None:
    samples, _ = load_samples([(material["alpaca"], "alpaca")], tokenizer, sequence_len=256, train_on_inputs=False)
    first = samples[0]
    answer = _trained_text(tokenizer, first)
    assert answer.endswith("</s>") and "### Response" not in answer and "Instruction" not in answer
    assert first.labels[0] == IGNORE_INDEX and first.labels[-1] == tokenizer.eos_token_id
    everything, _ = load_samples([(material["alpaca"], "alpaca")], tokenizer, sequence_len=256, train_on_inputs=True)
    assert "### Response" in _trained_text(tokenizer, everything[0])
    assert sum(label != IGNORE_INDEX for label in everything[0].labels) == len(first.input_ids) - 1  # all but BOS


def test_chat_template_trains_on_assistant_turns_only(material, tokenizer) -> None:
    samples, _ = load_samples([(material["chat"], "chat_template")], tokenizer, sequence_len=256, train_on_inputs=False)
    for sample in samples[:4]:
        trained = _trained_text(tokenizer, sample)
        assert trained.endswith("<|im_end|>\n") and "user" not in trained and "Be brief" not in trained
        assert trained.removesuffix("<|im_end|>\n").isupper()


def test_completion_trains_on_every_token(material, tokenizer) -> None:
    samples, _ = load_samples(
        [(material["completion"], "completion")], tokenizer, sequence_len=256, train_on_inputs=False
    )
    assert all(label != IGNORE_INDEX for label in samples[0].labels[1:])


def test_packing_fits_rows_first_fit_in_order() -> None:
    rows = pack([5, 4, 3, 2, 6], 8)
    assert [row.samples for row in rows] == [(0, 2), (1, 3), (4,)]
    assert [row.length for row in rows] == [8, 6, 6]


def _per_sample_losses(model, batch, bounds) -> list[float]:
    inputs, targets = split_causal_lm_batch(batch)
    with torch.no_grad():
        logits = model(**inputs).logits
    token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)
    return [float(token[row, start:end].sum()) for row, start, end in bounds]


def test_a_packed_row_gives_the_per_sample_losses_of_the_samples_alone(material, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(material["base"])
    model.config.use_cache = False
    samples, _ = load_samples([(material["alpaca"], "alpaca")], tokenizer, sequence_len=256, train_on_inputs=True)
    samples = samples[:6]
    packed = PackedSamples(samples, 256, tokenizer.pad_token_id)
    assert len(packed) < len(samples)  # several samples share a row
    rows = [packed[i] for i in range(len(packed))]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    bounds, expected = [], []
    for row_index, row in enumerate(packed.rows):
        offset = 0
        for index in row.samples:
            length = len(samples[index].input_ids)
            bounds.append((row_index, offset, offset + length))
            offset += length
            alone = PadCollate(tokenizer.pad_token_id)([PaddedSamples(samples)[index]])
            expected += _per_sample_losses(model, alone, [(0, 0, length)])
    got = _per_sample_losses(model, batch, bounds)
    assert len(got) == len(samples)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("example", ["lora.yaml", "full_zero3.yaml"])
def test_the_example_configs_resolve(material, example) -> None:
    job = resolve_finetune(ROOT / "examples" / "finetune" / example, [f"base_model={material['base']}"], env={})
    assert job.resolved.config.launch.nproc_per_node in (2, 4) and job.notes == ()
    assert (job.settings.adapter == "lora") == (example == "lora.yaml")


@pytest.mark.slow
def test_meshkit_finetune_launches_itself_on_two_ranks(tmp_path, material) -> None:
    path = write_config(tmp_path / "ft.yaml", material, val_set_size=4, generation_samples=1, max_steps=2)
    out = tmp_path / "launched"
    proc = meshkit("finetune", str(path), "nproc_per_node=2", f"output_dir={out}", "adapter=lora", "lora_r=2",
                   "lora_target_modules=[q_proj]", "zero_stage=3", timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 and len(summary["generations"]) == 1
    assert (summary["device"], summary["backend"], summary["attention"]) == ("cpu", "gloo", "sdpa")
    rows = summary["packed_rows"] or summary["samples"]["train"]  # 2 steps of 2 ranks × 2 rows: a share of an epoch
    assert summary["epochs"] == pytest.approx(2 * 2 * 2 / rows)
    (answer,) = summary["generations"]  # beside the answer it was trained for, judged
    outputs = {json.loads(line)["output"] for line in material["alpaca"].read_text().splitlines()}
    assert answer["expected"] in outputs and answer["right"] == (answer["answer"].strip() == answer["expected"])
    assert (out / "adapter_model.safetensors").is_file() and (out / "merged" / "config.json").is_file()
    banner = r"fine-tuning LlamaForCausalLM \([\d.]+M params, [\d.]+M trainable, LoRA\) on 2 rank\(s\), layout "
    assert re.search(banner, proc.stdout + proc.stderr), proc.stdout[-2000:]  # the user's class (FSDP renames it)
    assert "gemm_4bit_forward" not in proc.stderr  # bitsandbytes' line for a kernel it does without: the log's


def test_lora_layers_are_split_piece_by_piece_also_under_sequence_parallel(material) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshkit.config import TensorParallelConfig
    from meshkit.models.layer_roles import layer_roles
    from meshkit.models.structure import describe
    from meshkit.parallel.tensor.auto import TensorParallelError, tensor_plan
    from meshkit.parallel.tensor.lora import split_lora_layers

    def named_plan(model: torch.nn.Module, cfg: TensorParallelConfig) -> dict[str, str]:
        return tensor_plan(model, cfg, layer_roles(model, describe(model))).kinds

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(material["base"]))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "o_proj"])).get_base_model()
    split = split_lora_layers(model, named_plan(model, TensorParallelConfig()), sequence_parallel=False)
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert split.kinds[f"{q}.base_layer"] == "colwise" and split.kinds[f"{q}.lora_B.default"] == "colwise"
    assert split.kinds[f"{o}.base_layer"] == "rowwise" and split.kinds[f"{o}.lora_A.default"] == "rowwise"
    assert f"{q}.lora_A.default.weight" in split.whole and f"{o}.lora_B.default.weight" in split.whole
    assert f"{q}.lora_A.default" not in split.kinds and q not in split.kinds
    # under sequence parallel B of a row-split layer adds to this rank's sequence shard: its parts are summed
    sequence = split_lora_layers(model, named_plan(model, TensorParallelConfig()), sequence_parallel=True)
    assert f"{o}.lora_B.default.weight" in sequence.partial and f"{q}.lora_A.default.weight" in sequence.whole
    with pytest.raises(TensorParallelError, match="LoRA on the fused layer"):
        fused = get_peft_model(causal_lm("phi3"), LoraConfig(r=2, target_modules=["qkv_proj"])).get_base_model()
        split_lora_layers(fused, named_plan(fused, TensorParallelConfig()), sequence_parallel=False)


def test_the_loss_plot_draws_train_and_eval_loss(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    from meshkit.recipes.report import plot_losses

    path = plot_losses([3.0, 2.0, 1.5, 1.0], tmp_path / "loss.png", [(2, 2.5), (4, 2.1)])
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"


def test_a_model_without_sdpa_runs_its_own_default_attention(tmp_path, material) -> None:
    """Gemma-2's class refuses sdpa: with attn_implementation unset the model's own default (eager) runs."""
    from transformers import AutoTokenizer

    from tests.helpers.distributed import run_world
    from tests.helpers.finetune_runs import run_finetune

    tokenizer = AutoTokenizer.from_pretrained(material["base"])
    model = causal_lm("gemma2", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    path = write_config(tmp_path / "g.yaml", material, base_model=str(tmp_path / "gemma2"), max_steps=2)
    summary = run_world(run_finetune, 1, str(path), [f"output_dir={tmp_path / 'out'}"], timeout=180)[0]
    assert len(summary["losses"]) == 2 and all(loss == loss for loss in summary["losses"])
    assert summary["attention"] == "eager" and summary["device"] == "cpu"  # the summary says which attention ran
