"""The fine-tune's set-up before its loop: the model (base, tokens, freezing, LoRA), the optimizer and the step
plan (steps, evaluation and save cadence, warm-up) from the Axolotl keys."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshkit.core.errors import MeshkitError
from meshkit.data.chat_templates import template_note
from meshkit.engine.engine import Engine
from meshkit.engine.what_ran import note_ran
from meshkit.models.quantized import parameter_count
from meshkit.models.structure import describe
from meshkit.parallel.materialize import reset_adapters
from meshkit.recipes.finetune_config import FinetuneJob
from meshkit.recipes.hf_base import (
    add_tokens,
    attention_implementation,
    build_meta_model,
    dequantized_note,
    foreign_class,
    grow_vocabulary,
    load_model,
    load_tokenizer,
    loaded_as_note,
    weights_file,
)
from meshkit.recipes.quantized_base import INT8_CAST_NOTE, load_quantized_base
from meshkit.recipes.quantized_base import check_layout as check_quantized_layout
from meshkit.training.muon import split_for_muon
from meshkit.training.optimizers import axolotl_groups, build_optimizer, trainable_groups
from meshkit.training.optimizers import check_layout as check_optimizer_layout
from meshkit.training.schedules import build_schedule, jagged_restarts, warmup_steps
from meshkit.tuning.liger import apply_liger_kernels, liger_asked
from meshkit.tuning.lora import AdapterExport, apply_lora, bank_dropout_note, old_names_note
from meshkit.tuning.lora_init import InitialAdapters, PlannedLayer, changes_base, initialise, plan
from meshkit.tuning.qat import prepare_for_qat


class FinetuneError(MeshkitError):
    """Fine-tuning settings that cannot train; the message says what to change."""


@dataclass
class FinetuneModel:
    """The model to train: `base` is the transformers model (under LoRA the one peft wraps, `peft_model`);
    `model` is what the Engine prepares."""

    base: torch.nn.Module
    peft_model: Any | None
    model: torch.nn.Module
    tokenizer: Any
    attention: str | None
    parameters: int
    trainable: int
    # a LoRA initialisation besides peft's default: the layers to start, and (once started) their initial adapters
    init_layers: list[PlannedLayer] = field(default_factory=list)
    initial: InitialAdapters | None = None
    notes: tuple[str, ...] = ()  # one line each, said when training starts


def load_base(engine: Engine, job: FinetuneJob) -> tuple[Any, Any, str | None]:
    """The base model (loaded quantized, or built on the meta device), its tokenizer with the added tokens, and
    the attention implementation; says what it did."""
    s, cfg = job.settings, engine.config
    if s.tf32:
        if engine.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        else:
            engine.print("meshkit: tf32: true has no effect on a CPU (TF32 is a CUDA matmul mode)")
    attention, attention_note = attention_implementation(s.attn_implementation, engine.device.type)
    if attention_note:
        engine.print(f"meshkit: {attention_note}")
    check_quantized_layout(s, engine.zero_stage, engine.mesh.size("tp"), engine.mesh.size("pp"), cfg.precision)
    if s.quantization:
        base = load_quantized_base(s, attention, engine.device)
    elif s.reward_model or s.process_reward_model:  # a new head: transformers loads the base and starts the head
        torch.manual_seed(cfg.seed)  # (the same new head on every rank)
        base = load_model(s, attention, engine.device)
    else:
        base = build_meta_model(s, attention)
    if foreign_class(s.model_type):
        engine.print(
            f"meshkit: model_type {s.model_type} is not a transformers class (another package's): the checkpoint's "
            f"config.json makes it {type(base).__name__}"
        )
    dequantized = dequantized_note(s)
    if dequantized:
        engine.print(f"meshkit: {dequantized}")
    if s.quantization == "8bit":
        engine.print(f"meshkit: {INT8_CAST_NOTE}")
    if s.qat is not None:  # (before the weights stream in: the swapped layers keep the names)
        prepare_for_qat(base, s.qat, engine.device)
        engine.print(f"meshkit: {s.qat.describe()}")
    if s.reinit_weights:
        engine.print("meshkit: reinit_weights: the model starts from its own random initialisation, not the weights")
    liger_note = apply_liger_kernels(base, s, engine.device)
    if liger_note:
        engine.print(f"meshkit: {liger_note}")
    if liger_asked(s):
        note_ran(engine, "liger", f"not applied: {liger_note}" if liger_note else f"applied: {liger_asked(s)}")
    tokenizer = load_tokenizer(s)
    if s.tokenizer_use_mistral_common and s.eot_tokens:
        engine.print("meshkit: eot_tokens: Mistral's own tokenizer ends each turn with its end of sequence; the names "
                     "given are not read (as in Axolotl)")  # fmt: skip
    note = template_note(s.chat_template)
    if note:
        engine.print(f"meshkit: {note}")
    if s.reward_model:  # (the head reads each row's last token that is not padding)
        config: Any = base.config
        config.pad_token_id = tokenizer.pad_token_id
    loaded_as = loaded_as_note(s, base)
    if loaded_as:
        engine.print(f"meshkit: {loaded_as}")
    freeze_towers(engine, base)
    added = add_tokens(tokenizer, s)
    rows = grow_vocabulary(base, len(tokenizer))
    if added:
        grown = f"; the embedding grows from {rows} to {len(tokenizer)} rows, new ones at the mean of the others"
        frozen = " (frozen under LoRA: merged/ holds them)" if s.adapter and not s.lora_modules_to_save else ""
        engine.print(f"meshkit: added tokens {added}{grown if len(tokenizer) > rows else ''}{frozen}")
    return base, tokenizer, attention


def freeze_towers(engine: Engine, base: torch.nn.Module) -> None:
    """A multimodal base trained on text: its vision/audio encoders never run, so they are frozen (exported as
    loaded) instead of holding optimizer state and unused gradients."""
    towers = describe(base).towers
    if not towers:
        return
    count = 0
    for name in towers:
        for param in base.get_submodule(name).parameters():
            param.requires_grad_(False)
            count += param.numel()
    engine.print(
        f"meshkit: text data never runs {', '.join(towers)} ({count:,} parameters): frozen, exported as loaded"
    )


def adapt(job: FinetuneJob, base: torch.nn.Module, tokenizer: Any, attention: str | None) -> FinetuneModel:
    """`unfrozen_parameters` and LoRA over the base: the model the Engine prepares."""
    s = job.settings
    if s.unfrozen_parameters and s.adapter is None:
        freeze_all_but(base, s.unfrozen_parameters)
    renamed = old_names_note(base, s)
    peft_model = apply_lora(base, s) if s.adapter else None
    model = peft_model.get_base_model() if peft_model is not None else base
    if s.loads_whole and peft_model is not None:  # built whole: adapters seeded as a meta-built model's are
        reset_adapters(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = (
        plan(model, peft_model.peft_config["default"]) if peft_model and s.lora_init and not s.lora_model_dir else []
    )
    note = bank_dropout_note(peft_model, s) if peft_model is not None else None
    return FinetuneModel(
        base, peft_model, model, tokenizer, attention, parameter_count(model), trainable, layers,
        notes=tuple(line for line in (renamed, note) if line),
    )  # fmt: skip


def start_adapters(engine: Engine, job: FinetuneJob, built: FinetuneModel) -> None:
    """After `engine.prepare`: LoRA's initialisation when it is not peft's default (`meshkit.tuning.lora_init`)."""
    s = job.settings
    if not built.init_layers or built.peft_model is None or s.lora_init is None:
        return
    config = built.peft_model.peft_config["default"]
    source = weights_file(Path(s.base_model))
    bits = s.peft.loftq_config.loftq_bits if s.peft and s.peft.loftq_config else None
    built.initial = initialise(engine, built.init_layers, config, s.lora_init, source, engine.config.seed, bits)
    rewritten = ", the rest kept as the frozen base" if changes_base(s.lora_init) else ""
    if s.lora_init == "loftq":
        rewritten = "; the base is now its quantization: the adapter written at the end applies to it, merged/ is whole"
    engine.print(
        f"meshkit: LoRA starts as {s.lora_init} in {len(built.init_layers)} layers (computed by peft from the base "
        f"weights{rewritten})"
    )


def freeze_all_but(model: torch.nn.Module, patterns: tuple[str, ...]) -> None:
    """`unfrozen_parameters`: only parameters whose name matches one of the regexes train."""
    compiled = [re.compile(pattern) for pattern in patterns]
    matched = 0
    for name, param in model.named_parameters():
        param.requires_grad_(any(p.search(name) for p in compiled))
        matched += param.requires_grad
    if not matched:
        raise FinetuneError(f"unfrozen_parameters {list(patterns)} match no parameter of the model: fix the patterns")


def make_optimizer(model: torch.nn.Module, job: FinetuneJob, engine: Engine) -> torch.optim.Optimizer:
    """The trainable parameters (LoRA: the adapters only); no weight decay on biases and norm weights; LoRA+
    gives the B matrices their own learning rate."""
    s, cfg = job.settings, engine.config
    check_optimizer_layout(s.optimizer, engine.zero_stage, engine.mesh.size("tp"))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = trainable_groups((p for _, p in named), cfg.train.weight_decay)
    if s.embedding_lr is not None or s.embedding_lr_scale is not None or s.lr_groups:
        groups = axolotl_groups(
            named, _embedding_parameters(model), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
            embedding_lr=s.embedding_lr, embedding_lr_scale=s.embedding_lr_scale,
            lr_groups=[group.model_dump() for group in s.lr_groups or []],
        )  # fmt: skip
    if s.loraplus_lr_ratio is not None:
        fast = {id(p) for name, p in named if ".lora_B." in name}
        groups = [
            {**group, "params": [p for p in group["params"] if (id(p) in fast) == is_b], **extra}
            for group in groups
            for is_b, extra in ((False, {}), (True, {"lr": cfg.train.lr * s.loraplus_lr_ratio}))
        ]
        groups = [group for group in groups if group["params"]]
    if s.optimizer == "muon":
        groups = split_for_muon(groups, _embedding_parameters(model))
    optimizer, notes = build_optimizer(
        s.optimizer,
        groups,
        lr=cfg.train.lr,
        betas=(s.adam_beta1, s.adam_beta2),
        eps=s.adam_epsilon,
        extra=dict(s.optim_args or {}),
    )
    for note in notes:
        engine.print(f"meshkit: {note}")
    return optimizer


def _embedding_parameters(model: torch.nn.Module) -> set[int]:
    """Ids of the input embedding's and output head's parameters (transformers' accessors; with LoRA's
    modules_to_save, their trainable copies too)."""
    found: set[int] = set()
    for accessor in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, accessor, None)
        module = get() if callable(get) else None
        if isinstance(module, torch.nn.Module):
            found |= {id(param) for param in module.parameters()}
    return found


@dataclass(frozen=True)
class StepPlan:
    """How long the fine-tune runs and when it evaluates and saves, in optimizer steps."""

    total_steps: int
    eval_every: int | None
    save_every: int | None
    rows_per_step: int  # dataset rows one optimizer step reads over every data-parallel rank


def step_plan(engine: Engine, job: FinetuneJob, dataset_rows: int) -> StepPlan:
    """`max_steps` when given, else `num_epochs` over the data; Axolotl's eval_steps / evals_per_epoch and
    saves_per_epoch as step intervals."""
    s, cfg = job.settings, engine.config
    rows_per_step = cfg.train.global_micro_batch(engine.dp_size) * cfg.grad_accum_steps
    steps_per_epoch = max(1, dataset_rows // rows_per_step)
    total_steps = cfg.train.steps if job.steps_given() else max(1, math.ceil(s.num_epochs * steps_per_epoch))
    eval_every = s.eval_steps or per_epoch(steps_per_epoch, s.evals_per_epoch)
    return StepPlan(total_steps, eval_every, per_epoch(steps_per_epoch, s.saves_per_epoch), rows_per_step)


def make_schedule(engine: Engine, job: FinetuneJob, optimizer: Any, total_steps: int) -> tuple[Any, int]:
    """(the learning-rate schedule, its warm-up steps) from Axolotl's lr_scheduler keys."""
    s = job.settings
    warmup = warmup_steps(engine.config.train.warmup_steps, s.warmup_ratio, total_steps)
    scheduler = build_schedule(
        s.lr_scheduler, optimizer, warmup=warmup, total=total_steps, kwargs=s.lr_scheduler_kwargs,
        min_lr_ratio=s.cosine_min_lr_ratio, constant_lr_ratio=s.cosine_constant_lr_ratio,
        quadratic_warmup=s.lr_quadratic_warmup, div_factor=s.lr_div_factor,
    )  # fmt: skip
    if s.jagged_restart_steps:
        scheduler = jagged_restarts(
            scheduler, s.jagged_restart_steps, s.jagged_restart_warmup_steps, s.jagged_restart_anneal_steps,
            s.cosine_min_lr_ratio,
        )  # fmt: skip
    return scheduler, warmup


def per_epoch(steps_per_epoch: int, times: int | None) -> int | None:
    """Every how many steps something happens `times` per epoch (Axolotl's evals/saves_per_epoch)."""
    return None if times is None else max(1, steps_per_epoch // times)


def adapter_words(s: Any) -> str:
    """How the banner names the adapter: ', LoRA', ', QLoRA over a nf4 base', or nothing."""
    if not s.adapter:
        return ""
    return {"8bit": ", LoRA over an int8 base", "4bit": f", QLoRA over a {s.bnb_4bit_quant_type} base"}.get(
        s.quantization or "", ", LoRA"
    )


def rebuild_whole(job: FinetuneJob, built: FinetuneModel) -> AdapterExport | None:
    """What exporting the adapter in peft's format needs: a fresh LoRA model on the meta device, and the initial
    adapters of an initialisation that rewrote the base (None without LoRA)."""
    if built.peft_model is None:
        return None
    return AdapterExport(
        lambda: apply_lora(build_meta_model(job.settings, built.attention), job.settings), built.initial
    )
