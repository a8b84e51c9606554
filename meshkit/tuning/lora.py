"""LoRA for the fine-tuning recipe, through peft: wrap the base model, and write the adapter in peft's format.

The engine trains the transformers model inside the peft wrapper (`get_base_model()`: the same modules, with
LoRA layers injected), so every layout sees an ordinary transformers model. The adapter is written from the
gathered adapter weights alone — never the sharded state peft's own `save_pretrained` cannot read — as
`adapter_model.safetensors` + `adapter_config.json`, loadable by `PeftModel.from_pretrained`.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from meshkit.core.errors import MeshkitError
from meshkit.core.io import write_atomically
from meshkit.models.adapters import adapter_parameter_name, is_adapter_state
from meshkit.models.structure import describe
from meshkit.tuning.legacy_names import targets_by_old_names
from meshkit.tuning.lora_init import InitialAdapters, converted_adapter

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoraSetupError(MeshkitError):
    """LoRA settings that cannot be applied to the model."""


@dataclass(frozen=True)
class AdapterExport:
    """What writing the adapter needs: `whole_model` builds the LoRA model again (on the meta device: peft picks
    an adapter's entries by the model's LoRA layers, and the trained model may hold only its own pipeline
    stage's); `initial`: the initial adapters of a PiSSA/OLoRA start, to export for the original base."""

    whole_model: Callable[[], Any]
    initial: InitialAdapters | None = None


def apply_lora(model: nn.Module, settings: Any) -> Any:
    """The peft model around `model` (LoRA layers injected in place; base weights frozen)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise LoraSetupError("adapter: lora needs peft: pip install 'meshkit[hf]'") from None
    if getattr(settings, "lora_model_dir", None) is not None:
        config = continued_config(settings.lora_model_dir, str(settings.base_model))
    else:
        config = _new_config(settings, LoraConfig, model)
    dropout = config.lora_dropout if _wraps_expert_banks(config, model) else 0.0
    if dropout:  # peft's adapters on a fused expert bank take no dropout; the Linear layers' get it below
        config.lora_dropout = 0.0
    try:
        with warnings.catch_warnings():  # peft reads a property transformers has deprecated: not the user's doing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = get_peft_model(model, config)
    except ValueError as err:  # e.g. a target module name the model does not have
        raise LoraSetupError(f"LoRA cannot wrap this model: {str(err).splitlines()[0]}") from None
    if dropout:
        for layer in _layers(wrapped, banks=False):
            for name in layer.lora_dropout:
                layer.lora_dropout[name] = nn.Dropout(p=dropout)
    return wrapped


def _wraps_expert_banks(config: Any, model: nn.Module) -> bool:
    """Whether peft will put adapters on fused expert banks (its ParamWrapper): asked by lora_target_parameters,
    or by a name that transformers 4 gave each expert's own Linear layer (down_proj, w1, ...), which peft moves
    onto the bank transformers 5 fuses them into — as the config meant them."""
    if config.target_parameters:
        return True
    try:
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )
    except ImportError:  # (a peft without transformers 5's conversions)
        return False
    if not hasattr(getattr(model, "config", None), "model_type"):  # (not a transformers model: nothing moves)
        return False
    probe = copy.deepcopy(config)
    transformers_model: Any = model
    conversions = get_model_conversion_mapping(transformers_model)
    convert_peft_config_for_transformers(probe, model=model, conversions=conversions)
    return bool(probe.target_parameters)


def _layers(wrapped: Any, banks: bool) -> list[Any]:
    """The LoRA layers of a peft model: those on fused parameters (`banks`) or the others."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    return [m for m in wrapped.modules() if isinstance(m, LoraLayer) and isinstance(m, ParamWrapper) == banks]


def old_names_note(model: nn.Module, settings: Any) -> str | None:
    """One notice line where a `lora_target_modules` regex matched modules by their transformers-4 names."""
    pattern = getattr(settings, "lora_target_modules", None)
    matched = targets_by_old_names(model, pattern) if isinstance(pattern, str) and settings.adapter else None
    if not matched:
        return None
    return (
        f"lora_target_modules '{pattern}' names modules as transformers 4 did: {len(matched)} modules matched "
        f"through transformers' own renames (e.g. {matched[0]})"
    )


def bank_dropout_note(wrapped: Any, settings: Any) -> str | None:
    """One notice line where lora_dropout could not reach the adapters of fused expert banks; else None."""
    if not getattr(settings, "lora_dropout", 0) or not _layers(wrapped, banks=True):
        return None
    return (
        f"lora_dropout {settings.lora_dropout} applies to the Linear layers' adapters; peft's adapters on the fused "
        "expert banks (transformers 5 fuses each expert's projections into one parameter) take none, and the "
        "exported adapter_config.json says lora_dropout 0 (peft could not load it otherwise)"
    )


def linear_targets(model: nn.Module) -> list[str]:
    """`lora_target_linear`: every Linear layer but the output head (or a classification head: a reward model's
    trains whole, as peft's classification tasks save it) and a multimodal model's encoders, by name — and nothing
    else. (peft's own "all-linear"
    also wraps the fused expert banks of a mixture-of-experts model, which only lora_target_parameters asks for.)
    Layer names where they name Linear layers only; full paths otherwise."""
    from transformers.pytorch_utils import Conv1D  # (GPT-2's linear layers)

    kinds = (nn.Linear, Conv1D)
    outputs: Any = getattr(model, "get_output_embeddings", None)
    head = outputs() if callable(outputs) else None
    structure = describe(model)
    if structure.classifier is not None:
        head = model.get_submodule(structure.classifier)

    def in_tower(name: str) -> bool:  # (a multimodal model's encoders: text batches never run them)
        return any(name == tower or name.startswith(tower + ".") for tower in structure.towers)

    linear = [name for name, module in model.named_modules()
              if isinstance(module, kinds) and module is not head and not in_tower(name)]  # fmt: skip
    if not linear:
        raise LoraSetupError("lora_target_linear: the model has no Linear layer besides its head")
    others = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
              if not isinstance(module, kinds) or in_tower(name)}  # fmt: skip
    short = {name.rsplit(".", 1)[-1] for name in linear}
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    if short & others or (head_name is not None and head_name.rsplit(".", 1)[-1] in short):
        return sorted(linear)
    return sorted(short)


def _new_config(settings: Any, LoraConfig: Any, model: nn.Module) -> Any:  # noqa: N803 (peft's class, lazily)
    parameters = list(getattr(settings, "lora_target_parameters", None) or []) or None
    if settings.lora_target_linear:
        targets: Any = linear_targets(model)
    elif isinstance(settings.lora_target_modules, str):  # (peft: a regular expression over whole module paths)
        targets = targets_by_old_names(model, settings.lora_target_modules) or settings.lora_target_modules
    elif settings.lora_target_modules:
        targets = list(settings.lora_target_modules)
    elif parameters:
        targets = []  # the named parameters only
    else:
        raise LoraSetupError(
            "adapter: lora needs lora_target_modules (e.g. [q_proj, v_proj]), lora_target_parameters or "
            "lora_target_linear: true"
        )
    saved = getattr(settings, "lora_modules_to_save", None)
    config = LoraConfig(
        r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=targets,
        target_parameters=parameters,
        use_rslora=getattr(settings, "peft_use_rslora", False),
        use_dora=getattr(settings, "peft_use_dora", False),
        modules_to_save=list(saved) if saved else None,
        layers_to_transform=list(settings.peft_layers_to_transform)
        if getattr(settings, "peft_layers_to_transform", None)
        else None,
        layers_pattern=_listed(getattr(settings, "peft_layers_pattern", None)),
        rank_pattern=dict(getattr(settings, "lora_rank_pattern", None) or {}),
        alpha_pattern=dict(getattr(settings, "lora_alpha_pattern", None) or {}),
        task_type=task_type(settings),
        base_model_name_or_path=str(settings.base_model),
    )
    return config


def task_type(settings: Any) -> str:
    """peft's task of the model: a reward model's adapter carries its new head (peft saves a classification
    task's head with the adapter), so `AutoPeftModelFor...Classification` loads it whole."""
    if getattr(settings, "reward_model", False):
        return "SEQ_CLS"
    if getattr(settings, "process_reward_model", False):
        return "TOKEN_CLS"
    return "CAUSAL_LM"


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def continued_config(directory: Path, base_model: str) -> Any:
    """`lora_model_dir`: the LoRA settings of the adapter being continued, from its adapter_config.json (the
    config's own lora_* keys do not apply, as when peft loads an adapter)."""
    from peft import LoraConfig

    if not (directory / ADAPTER_CONFIG).is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise LoraSetupError(
            f"lora_model_dir '{directory}' holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}: point it at a "
            "directory a LoRA run wrote (its output_dir)"
        )
    try:
        config = LoraConfig.from_pretrained(str(directory))
    except (TypeError, ValueError) as err:
        raise LoraSetupError(f"lora_model_dir '{directory}': {ADAPTER_CONFIG} is not a LoRA config ({err})") from None
    config.inference_mode = False
    config.base_model_name_or_path = base_model
    return config


def continued_weights(directory: Path, model: nn.Module) -> dict[str, Any]:
    """The adapter weights of `lora_model_dir` under `model`'s parameter names; they must be exactly the
    adapter parameters `model` has."""
    from safetensors.torch import load_file

    weights = {adapter_parameter_name(k): v for k, v in load_file(str(directory / ADAPTER_WEIGHTS)).items()}
    wanted = {name for name, _ in model.named_parameters() if is_adapter_state(name)}
    missing, unknown = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
    if missing or unknown:
        raise LoraSetupError(
            f"lora_model_dir '{directory}' does not fit this model: missing {missing[:3]}, unexpected "
            f"{unknown[:3]}; was it trained on another base model?"
        )
    return weights


def save_adapter(engine: Any, export: AdapterExport, out_dir: Path) -> Path | None:
    """Collective: gathers the adapter weights; the main process writes them in peft's format to `out_dir`."""
    from peft import get_peft_model_state_dict

    adapter = engine.full_state_dict(keys=is_adapter_state)
    if not engine.is_main_process:
        return None
    peft_model = export.whole_model()
    prefixed = {f"base_model.model.{name}": tensor.detach().cpu().contiguous() for name, tensor in adapter.items()}
    weights = get_peft_model_state_dict(peft_model, state_dict=prefixed)
    config = peft_model.peft_config["default"].to_dict()
    if export.initial is not None:
        weights, config = converted_adapter(weights, config, export.initial)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(out_dir / ADAPTER_WEIGHTS, tensors={k: v.contiguous() for k, v in weights.items()})
    write_atomically(out_dir / ADAPTER_CONFIG, text=json.dumps(_jsonable(config), indent=2, sort_keys=True))
    return out_dir


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, set):
        return [_jsonable(v) for v in sorted(value, key=str)]
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # enums (task type) and paths
