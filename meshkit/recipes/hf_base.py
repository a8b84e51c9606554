"""The base model directory of a fine-tune: its tokenizer, the model built on the meta device (weights stream
in later, one tensor at a time, into this rank's shards only), its weight files, and the outputs that must
carry its files (tokenizer, generation sample)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshkit.core.errors import MeshkitError
from meshkit.data.chat_templates import chat_template
from meshkit.models.structure import describe
from meshkit.recipes.mistral_tokenizer import mistral_common_tokenizer
from meshkit.recipes.token_overrides import renamed_added_tokens

WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors")


class BaseModelError(MeshkitError):
    """A base model directory that cannot be used; the message names the file that is missing or wrong."""


def weights_file(directory: Path) -> Path:
    """The safetensors index (sharded) or single file of a `save_pretrained` directory."""
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    if not directory.is_dir():
        raise BaseModelError(f"base_model '{directory}' is not a directory: give a save_pretrained directory")
    if any(directory.glob("*.bin")):
        raise BaseModelError(
            f"base_model '{directory}' has only pickle (.bin) weights: convert them to safetensors "
            "(save_pretrained with safe_serialization) first"
        )
    raise BaseModelError(f"base_model '{directory}' has no model.safetensors or model.safetensors.index.json")


# What a tokenizer is saved as: one of these (or pair) makes a directory loadable by AutoTokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json + merges.txt",
    "vocab.txt",
    "tekken.json",
)


def tokenizer_directory(settings: Any) -> Path:
    """Where the tokenizer is read from (`tokenizer_config`, else `base_model`), refused in one line when it holds
    no tokenizer files — checked by the launcher too, before any worker starts."""
    directory = Path(settings.tokenizer_config or settings.base_model)
    found = any(all((directory / part).is_file() for part in name.split(" + ")) for name in TOKENIZER_FILES)
    if directory.is_dir() and not found:
        key = "tokenizer_config" if settings.tokenizer_config else "base_model"
        raise BaseModelError(
            f"{key} '{directory}' has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}): save the "
            "tokenizer there (tokenizer.save_pretrained), or set tokenizer_config to a directory that has them"
        )
    return directory


def load_tokenizer(settings: Any) -> Any:
    from transformers import AutoTokenizer

    directory = tokenizer_directory(settings)
    kind = settings.tokenizer_type
    options = {"local_files_only": True, "use_fast": settings.tokenizer_use_fast}
    if settings.tokenizer_use_mistral_common:
        return mistral_common_tokenizer(directory)
    try:
        if kind in (None, "AutoTokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(directory, **options)
        else:
            import transformers

            tokenizer_class = getattr(transformers, kind, None)
            if tokenizer_class is None:
                raise BaseModelError(f"tokenizer_type '{kind}' is not a transformers tokenizer class")
            tokenizer = tokenizer_class.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        if isinstance(err, MeshkitError):
            raise
        reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())  # (one line, not cut)
        raise BaseModelError(f"cannot load the tokenizer from '{directory}': {reason[:400]}") from None
    if settings.added_tokens_overrides:
        tokenizer = renamed_added_tokens(tokenizer, settings.added_tokens_overrides)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise BaseModelError(f"the tokenizer in '{directory}' has neither a pad nor an eos token: add one")
        tokenizer.pad_token = tokenizer.eos_token  # padding never counts: its labels are -100
    template = chat_template(settings.chat_template, settings.chat_template_jinja, tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def add_tokens(tokenizer: Any, settings: Any) -> list[str]:
    """`special_tokens` (bos/eos/pad/unk, ...) and `tokens` into the tokenizer; returns the tokens that were new."""
    before = len(tokenizer)
    special = dict(settings.special_tokens or {})
    if special:
        tokenizer.add_special_tokens(special)
    if settings.tokens:
        tokenizer.add_tokens(list(settings.tokens))
    return [tokenizer.convert_ids_to_tokens(i) for i in range(before, len(tokenizer))]


def grow_vocabulary(model: Any, rows: int) -> int:
    """Embedding (and untied head) rows up to `rows` for tokens added to the tokenizer; returns the rows it had.
    The new rows start as the mean of the others: here for a model built whole, as the weights stream in for one
    built on the meta device (`meshkit.parallel.materialize.grown_rows`)."""
    from meshkit.parallel.materialize import grown_rows

    before = model.get_input_embeddings().num_embeddings
    if rows <= before:
        return before
    model.resize_token_embeddings(rows, mean_resizing=False)
    for layer in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m}.values():
        for part in (layer.weight, getattr(layer, "bias", None)):  # (a head's bias has a row per token: Phi's)
            if isinstance(part, torch.Tensor) and not part.is_meta:
                with torch.no_grad():
                    part.copy_(grown_rows(part[:before], rows))
    return before


def attention_implementation(requested: str | None, device: str = "cpu") -> tuple[str | None, str | None]:
    """The attention the model runs, and a notice when it is not the one asked for (a kernel not installed, or
    one that cannot train on this device): then the model's own default runs (None: sdpa where its class has it;
    Gemma-2, e.g., has not: eager)."""
    import importlib.util

    default = "the model's default attention (sdpa where the model has it)"
    if requested is None:
        return None, None
    if requested == "flex_attention" and device == "cpu":
        return None, f"attn_implementation: flex_attention has no backward on a CPU (torch's kernel): runs {default}"
    if requested in ("sdpa", "eager", "flex_attention"):
        return requested, None
    if requested.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        return None, f"attn_implementation: {requested} needs flash-attn (a CUDA kernel, not installed): runs {default}"
    if "/" in requested:  # a hub kernel (`kernels-community/...`): fetched by the kernels package, for CUDA
        return None, f"attn_implementation: {requested} is a hub kernel (CUDA, fetched online): runs {default}"
    if requested not in _registered_attention():  # e.g. xformers: Axolotl patches its CUDA kernel in
        return None, f"attn_implementation: {requested} is not an attention transformers has here: runs {default}"
    return requested, None


def _registered_attention() -> set[str]:
    """The attention implementations transformers runs by name (its registry, with eager)."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return {"eager", "sdpa"}
    return {"eager", *AttentionInterface._global_mapping}


def model_recipe(settings: Any, attention: str | None = "sdpa") -> tuple[Any, Any]:
    """The model class `model_type` names and the base's config (overrides applied, attention set, no cache)."""
    import transformers
    from transformers import AutoConfig

    directory = Path(settings.base_model_config or settings.base_model)
    weights_file(Path(settings.base_model))
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise BaseModelError(f"cannot read config.json in '{directory}': {str(err).splitlines()[0]}") from None
    kind = settings.model_type
    if getattr(settings, "reward_model", False):  # a sequence-classification head with one output
        kind = kind if kind.endswith("ForSequenceClassification") else "AutoModelForSequenceClassification"
        config.num_labels = 1
    if getattr(settings, "process_reward_model", False):  # a token-classification head: each step wrong or right
        kind = kind if kind.endswith("ForTokenClassification") else "AutoModelForTokenClassification"
        config.num_labels = 2
    model_class = getattr(transformers, text_model_class(kind, config), None)
    if model_class is None or not hasattr(model_class, "from_pretrained"):
        raise BaseModelError(f"model_type '{kind}' is not a transformers model class (e.g. AutoModelForCausalLM)")
    wanted = getattr(model_class, "config_class", None)
    if isinstance(wanted, type) and not isinstance(config, wanted) and isinstance(config.get_text_config(), wanted):
        config = config.get_text_config()  # a multimodal checkpoint's language model: its own (text) config
    for key, value in (settings.overrides_of_model_config or {}).items():
        setattr(config, key, value)
    config._attn_implementation = attention
    config.use_cache = False  # training: packed rows keep attention inside each sample
    return model_class, config


def checkpoint_quantization(config: Any) -> str | None:
    """The quantization a checkpoint was released in (its config's `quantization_config.quant_method`), if any."""
    found = getattr(config, "quantization_config", None)
    method = found.get("quant_method") if isinstance(found, dict) else getattr(found, "quant_method", None)
    return str(getattr(method, "value", method)) if method else None


def dequantized_note(settings: Any) -> str | None:
    """One line when the base was released quantized in a format meshkit trains dequantized (MXFP4: gpt-oss)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(settings.base_model_config or settings.base_model, local_files_only=True)
    if checkpoint_quantization(config) != "mxfp4":
        return None
    kept = (settings.model_quantization_config_kwargs or {}).get("dequantize", True) is False
    asked = " (dequantize: false asks to keep MXFP4, which does not train)" if kept else ""
    return (f"the base is stored in MXFP4: its expert weights are dequantized as they load{asked}, as transformers' "
            "Mxfp4Config(dequantize=True) does")  # fmt: skip


def loaded_as_note(settings: Any, model: nn.Module) -> str | None:
    """One line when the class trained is not the multimodal class `model_type` named (`text_model_class`)."""
    asked, loaded = str(settings.model_type), type(model).__name__
    if asked.startswith("Auto") or asked == loaded or not asked.endswith("ForConditionalGeneration"):
        return None
    return (f"model_type {asked} on text data trains its language model, {loaded} (text batches never run the "
            "vision tower; the export holds the language model)")  # fmt: skip


def foreign_class(kind: str) -> bool:
    """`model_type` names a class transformers does not have (another package's: mamba_ssm's MambaLMHeadModel,
    a remote-code class): the checkpoint's config.json then says which transformers class it is."""
    import transformers

    return not kind.startswith("Auto") and not hasattr(transformers, kind)


def text_model_class(kind: str, config: Any) -> str:
    """The class that trains `config`'s checkpoint on text, for the `model_type` asked: one transformers does not
    have is the causal LM of the checkpoint's own model type (`foreign_class`); an audio-text checkpoint with no
    causal LM (Voxtral) loads as its own multimodal class; a multimodal checkpoint that
    transformers maps to no causal LM (Mistral 3) loads as Axolotl loads it, image-text-to-text; one it maps to a
    causal LM loads as that (Llama 4: its language model, Llama4ForCausalLM) when the multimodal class is asked by
    name — text batches never run the vision tower."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = str(getattr(config, "model_type", ""))
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if foreign_class(kind) and causal is not None:
        return causal
    if kind == "AutoModelForCausalLM" and causal is None and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return "AutoModelForImageTextToText"
    if kind == "AutoModelForCausalLM" and causal is None:  # an audio-text checkpoint (Voxtral): its own class
        return str(modeling_auto.__dict__.get("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {}).get(model_type, kind))
    if kind == MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type) and causal and causal.endswith("ForCausalLM"):
        return causal
    return kind


def _causal_lm(model: Any, settings: Any) -> nn.Module:
    """The model, if it is what the recipe trains (the structure layer says): a causal LM, or for a reward model a
    sequence classifier (a process reward model: a token classifier)."""
    model.config.use_cache = False
    structure = describe(model)
    wanted, fits = "causal LMs", structure.causal_lm
    if getattr(settings, "reward_model", False):
        wanted, fits = "sequence classifiers as reward models", structure.classifier is not None and structure.pooled
    if getattr(settings, "process_reward_model", False):
        wanted = "token classifiers as process reward models"
        fits = structure.classifier is not None and not structure.pooled
    if not fits:
        directory = settings.base_model_config or settings.base_model
        raise BaseModelError(f"meshkit finetune trains {wanted}; '{directory}' builds {type(model).__name__}")
    return model


def build_meta_model(settings: Any, attention: str | None = "sdpa") -> nn.Module:
    """The base model's architecture on the meta device (no memory); its weights stream in later."""
    model_class, config = model_recipe(settings, attention)
    # Auto classes build through from_config, a model class (LlamaForCausalLM) through its own _from_config
    build = getattr(model_class, "from_config", None) or getattr(model_class, "_from_config", None)
    if build is None:
        raise BaseModelError(f"model_type '{settings.model_type}' cannot build a model from a config")
    if checkpoint_quantization(config) == "mxfp4":  # streamed dequantized: the model (and its export) is not MXFP4
        del config.quantization_config
    with torch.device("meta"):
        model = build(config)
    return _causal_lm(model, settings)


def load_model(settings: Any, attention: str | None, device: torch.device, **options: Any) -> nn.Module:
    """The base model loaded whole by transformers' `from_pretrained` onto `device` (a quantized base: its
    `quantization_config` in `options` quantizes each weight as it loads); other parameters in float32."""
    model_class, config = model_recipe(settings, attention)
    if checkpoint_quantization(config) == "mxfp4":
        if "quantization_config" in options:
            raise BaseModelError(
                f"'{settings.base_model}' is stored in MXFP4 and loads dequantized; load_in_8bit / load_in_4bit cannot "
                "quantize it again in the same load: drop them (LoRA trains over the dequantized base)"
            )
        from transformers.utils.quantization_config import Mxfp4Config

        options["quantization_config"] = Mxfp4Config(dequantize=True)  # trainable weights, on every device
    try:
        model = model_class.from_pretrained(
            settings.base_model,
            config=config,
            dtype=torch.float32,
            device_map={"": device},
            local_files_only=True,
            **options,
        )
    except (OSError, ValueError, ImportError) as err:
        raise BaseModelError(f"cannot load '{settings.base_model}': {str(err).splitlines()[0]}") from None
    except RuntimeError as err:  # transformers' report of checkpoint tensors that do not fit the model's
        raise BaseModelError(
            f"cannot load '{settings.base_model}' as {settings.model_type}: its tensors do not fit the model's (a "
            f"head of another size, e.g. num_labels): {str(err).splitlines()[0]}"
        ) from None
    return _causal_lm(model, settings)


def write_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Tokenizer files into an export directory (each file replaced atomically)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tokenizer-") as staging:
        tokenizer.save_pretrained(staging)
        for file in Path(staging).iterdir():
            os.replace(file, out_dir / file.name)


def prompt_ids(input_ids: tuple[int, ...], labels: tuple[int, ...], ignore_index: int) -> list[int]:
    """The tokens before the first trained token (for a completion, whose every token trains: its first half)."""
    first = next((i for i, label in enumerate(labels) if i > 0 and label != ignore_index), len(labels))
    return list(input_ids[: first if first > 1 else max(1, len(input_ids) // 2)])


def generate_samples(
    model_dir: Path, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, stop: set[int] | None = None
) -> list[dict[str, Any]]:
    """Greedy answers of the exported model to a few tokenized prompts (one process, CPU); `stop`: token ids
    that end an answer besides the EOS (end-of-turn tokens)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model_class = getattr(transformers, text_model_class("AutoModelForCausalLM", config))
    model = model_class.from_pretrained(model_dir, local_files_only=True)
    model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                **({"eos_token_id": sorted(stop | {tokenizer.eos_token_id} - {None})} if stop else {}),
            )
        out.append(
            {
                "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                "answer": tokenizer.decode(generated[0, len(prompt) :], skip_special_tokens=True),
            }
        )
    return out


def replace_directory(staging: Path, final: Path) -> None:
    """Put a completely written `staging` directory in the place of `final` (an earlier export is removed
    only once the new one is in place)."""
    old = final.with_name(f".{final.name}-old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    if old.exists():
        shutil.rmtree(old)
