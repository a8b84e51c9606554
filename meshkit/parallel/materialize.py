"""Meta-device initialisation: build on `meta`, shard, then materialise only this rank's shard.

`torch.device("meta")` builds a model of any size without memory. After sharding, `to_empty` allocates just
this rank's shards, and the weights are filled module by module, never holding more than one module's full
tensors: either by the model's own init (`init_module(name, module)`, else each module's `reset_parameters`) in
`named_modules` order — the order eager construction uses, so the weights equal an eager model's under the same
seed — or from a safetensors file (or an index of shards), one tensor at a time.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshkit.core.errors import MeshkitError
from meshkit.models import hf_adapter
from meshkit.models.adapters import adapter_submodules, base_checkpoint_name, is_adapter_parameter, reset_adapter
from meshkit.models.checkpoint_names import CheckpointConversion
from meshkit.parallel.tensor.storage import SplitWeights
from meshkit.runtime.dtensors import local_tensor


class MaterializeError(MeshkitError):
    """A meta-device model that cannot be filled; the message says what it lacks."""


def set_local(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor `full` into `target` (a DTensor shard or a plain tensor)."""
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank holds the same full tensor and keeps its own slice, no communication
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


@contextlib.contextmanager
def _full_size(module: nn.Module) -> Iterator[None]:
    """Temporarily give `module` full-size plain parameters in place of its shards, then keep its shard."""
    sharded = {name: cast(DTensor, p) for name, p in module._parameters.items() if isinstance(p, DTensor)}
    for name, param in sharded.items():
        full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
    try:
        yield
        for name, param in sharded.items():
            set_local(param, cast(nn.Parameter, module._parameters[name]).detach())
    finally:
        module._parameters.update(cast(dict[str, nn.Parameter | None], sharded))


@contextlib.contextmanager
def _adapters_full_size(module: nn.Module) -> Iterator[bool]:
    """Full-size adapter weights of a LoRA layer (yields False, and does nothing, for any other module)."""
    parts = adapter_submodules(module)
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(_full_size(part))
        yield bool(parts)


def module_initializer(model: nn.Module) -> Callable[[str, nn.Module], None]:
    """The model's `init_module(name, module)`, a transformers model's own initialisation, else a call of each
    module's own `reset_parameters`."""
    own = getattr(model, "init_module", None)
    if callable(own):
        return own
    from_family = hf_adapter.module_initializer(model)
    if from_family is not None:
        return from_family
    lacking = [
        name or type(model).__name__
        for name, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False)) and not hasattr(module, "reset_parameters")
    ]
    if lacking:
        raise MaterializeError(
            f"cannot initialise a meta-device model: modules {lacking[:5]} have parameters but no reset_parameters; "
            "give the model an init_module(name, module) method, or set sharding.init_from to a safetensors file"
        )

    def reset(_name: str, module: nn.Module) -> None:
        own_reset = getattr(module, "reset_parameters", None)
        if callable(own_reset):
            own_reset()

    return reset


@torch.no_grad()
def initialize(model: nn.Module) -> None:
    """Fill every module in `named_modules` order; full tensors exist for one module at a time."""
    init = module_initializer(model)
    for name, module in model.named_modules():
        with _full_size(module):
            init(name, module)
    for name, module in model.named_modules():  # after their children's generic init: adapters start as a no-op
        _reset_adapters(name, module)


def reset_adapters(model: nn.Module) -> None:
    """Every LoRA layer's adapters to their seeded initial values (see `_reset_adapters`): for a model built
    whole rather than on the meta device, so that its adapters start as a meta-built model's do."""
    for name, module in model.named_modules():
        _reset_adapters(name, module)


def _reset_adapters(name: str, module: nn.Module) -> None:
    """A LoRA layer's initial adapter weights, drawn from a generator seeded by the run seed and the layer's
    name: the same values whichever ranks or pipeline stages initialise which layers."""
    with _adapters_full_size(module) as is_lora_layer:
        if is_lora_layer:
            device = next(module.parameters()).device
            accelerators = [device.index or 0] if device.type != "cpu" else []
            with torch.random.fork_rng(devices=accelerators, device_type=device.type if accelerators else "cuda"):
                torch.manual_seed((torch.initial_seed() + zlib.crc32(name.encode())) % 2**63)
                reset_adapter(module)


def safetensors_files(source: Path) -> dict[str, Path]:
    """Tensor name -> file, from a `.safetensors` file or a `model.safetensors.index.json`."""
    if not source.is_file():
        raise MaterializeError(f"sharding.init_from '{source}' does not exist")
    if source.suffix == ".json":
        weight_map = json.loads(source.read_text())["weight_map"]
        return {name: source.parent / file for name, file in weight_map.items()}
    with safe_open(str(source), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), source)


@torch.no_grad()
def load_safetensors(
    model: nn.Module,
    source: Path,
    stage_only: bool = False,
    aliases: dict[str, str] | None = None,
    split_weights: SplitWeights | None = None,
    vocabulary: tuple[str, ...] = (),
) -> None:
    """Stream tensors from safetensors into the (sharded) model, one full tensor in memory at a time.

    Adapter weights (LoRA) are not in a base checkpoint: they get their own initialisation; a wrapped layer's
    weight is read under its base name. Buffers outside the state dict (e.g. rotary tables) are recomputed.
    `stage_only`: the model is one pipeline stage, so the file holds other stages' tensors too. `aliases`: tied
    parameter name -> the name it is stored under (a checkpoint holds a tied weight once, e.g. GPT-2's head as
    its token embedding), also for a pipeline stage that holds only the alias. `split_weights`: how tensor parallel
    stores fused weights; the file's tensors go to that order as they stream in. `vocabulary`:
    parameters with one row per token; where the model has more rows than the file (tokens added to the
    tokenizer), the extra rows start as the mean of the file's rows (transformers' resize_token_embeddings).
    """
    targets = model.state_dict(keep_vars=True)  # parameters and persistent buffers, as the model holds them
    files, file_keys = _as_model_names(model, safetensors_files(source), targets)
    aliases = aliases or {}
    stored_as = {}
    for name in targets:
        if not is_adapter_parameter(name):
            stored = base_checkpoint_name(name)
            tied = base_checkpoint_name(aliases.get(name, name))
            stored_as[name] = stored if stored in files or tied not in files else tied
    missing = sorted(name for name, stored in stored_as.items() if stored not in files)
    converted = _converted(model, files, missing, stored_as)
    for name in missing:  # a tied weight whose one copy the file holds under an older name (Gemma 3's multimodal
        tied = base_checkpoint_name(aliases.get(name, name))  # checkpoints: language_model.model.embed_tokens)
        if stored_as[name] not in converted and tied in converted:
            stored_as[name] = tied
    missing = [name for name in missing if stored_as[name] not in converted]
    used = set(stored_as.values()) | {key for parts in converted.values() for key, _ in parts}
    unexpected = [] if stage_only else sorted(set(files) - used)
    if missing or unexpected:
        raise MaterializeError(
            f"'{source}' does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    by_file: dict[Path, list[str]] = {}
    for name, stored in stored_as.items():
        if stored in converted:
            continue
        by_file.setdefault(files[stored], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                full = handle.get_tensor(file_keys.get(stored_as[name], stored_as[name]))
                _fill(targets[name], name, full, file.name, vocabulary, split_weights)
    for name, stored in stored_as.items():
        if stored in converted:  # merged from several tensors, as transformers' from_pretrained does
            full = converted.conversion.tensor(
                stored, converted[stored], lambda key: _read(files[key], file_keys.get(key, key))
            )
            _fill(targets[name], name, full, "the merged checkpoint tensors", vocabulary, split_weights)
    init = getattr(model, "init_module", None) or hf_adapter.module_initializer(model)
    for name, module in model.named_modules():
        _reset_adapters(name, module)
        if init and module._non_persistent_buffers_set:  # RoPE tables; Gemma's embedding scale beside its weight
            _recompute_buffers(init, name, module)


@torch.no_grad()
def _recompute_buffers(init: Any, name: str, module: nn.Module) -> None:
    """The module's buffers that no checkpoint holds, recomputed by the model's own initialisation; the weights
    the module owns (just loaded) stand on the meta device meanwhile, so that it changes none of them."""
    loaded = dict(module._parameters)
    for key, param in loaded.items():
        if param is not None:
            stand_in = torch.empty(param.shape, dtype=param.dtype, device="meta")
            module._parameters[key] = nn.Parameter(stand_in, param.requires_grad)
    try:
        init(name, module)
    finally:
        module._parameters.update(loaded)


def _as_model_names(
    model: nn.Module, files: dict[str, Path], targets: dict[str, torch.Tensor]
) -> tuple[dict[str, Path], dict[str, str]]:
    """(files by the names the model reads, those names -> the file's own). The model may be one part of the
    checkpoint's model — Llama 4's language model in a multimodal checkpoint, its tensors under `language_model.`
    (its base_model_prefix), as transformers' from_pretrained reads them: then only that part's tensors count."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    names = {base_checkpoint_name(name) for name in targets if not is_adapter_parameter(name)}
    if prefix == "." or names & files.keys() or not any(prefix + name in files for name in names):
        return files, {}
    inner = {key[len(prefix) :]: key for key in files if key.startswith(prefix)}
    return {name: files[key] for name, key in inner.items()}, inner


class _Converted(dict):
    """Model tensor name -> its file tensors, and the conversion that merges them."""

    conversion: CheckpointConversion


def _converted(model: nn.Module, files: dict[str, Path], missing: list[str], stored_as: dict[str, str]) -> _Converted:
    """The missing tensors transformers' conversion makes from the file's (empty when it has none)."""
    out = _Converted()
    conversion = CheckpointConversion.of(model) if missing else None
    if conversion is not None:
        wanted = {stored_as[name] for name in missing}
        out.update(conversion.sources((key for key in files if key not in stored_as.values()), wanted))
        out.conversion = conversion
    return out


def _read(file: Path, key: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(key)


def _fill(
    target: torch.Tensor,
    name: str,
    full: torch.Tensor,
    where: str,
    vocabulary: tuple[str, ...],
    split_weights: SplitWeights | None,
) -> None:
    """Copy this rank's part of the checkpoint's `full` tensor into the model's `target` (parameter `name`)."""
    if base_checkpoint_name(name) in vocabulary:
        full = grown_rows(full, target.shape[0])
    if tuple(full.shape) != tuple(target.shape):
        shapes = f"has shape {tuple(full.shape)} in {where}; the model has {tuple(target.shape)}"
        raise MaterializeError(f"'{name}' {shapes}")
    if split_weights is not None:
        full = split_weights.to_storage(name, full)
    device = local_tensor(target).device
    set_local(target, full.to(device=device, dtype=target.dtype))


def grown_rows(stored: torch.Tensor, rows: int) -> torch.Tensor:
    """`stored` with rows appended up to `rows`, each the mean of the stored rows (unchanged if not fewer)."""
    if stored.dim() == 0 or stored.shape[0] >= rows:
        return stored
    mean = stored.float().mean(dim=0, keepdim=True).to(stored.dtype)
    return torch.cat([stored, mean.expand(rows - stored.shape[0], *stored.shape[1:])])


def _tied_places(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) of each parameter held by several modules (a head tied to the input embedding)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, key))
    return [found for found in places.values() if len(found) > 1]


def materialize(
    model: nn.Module,
    device: torch.device,
    source: Path | None = None,
    stage_only: bool = False,
    aliases: dict[str, str] | None = None,
    split_weights: SplitWeights | None = None,
    vocabulary: tuple[str, ...] = (),
) -> None:
    """Allocate the meta-device model's (local) tensors on `device` and fill them (see `load_safetensors`)."""
    tied = _tied_places(model)
    model.to_empty(device=device)  # (gives each module a parameter of its own: a tied head stops being tied)
    for places in tied:
        first_module, first_key = places[0]
        for module, key in places[1:]:
            module._parameters[key] = first_module._parameters[first_key]
    if source is not None:
        load_safetensors(model, source, stage_only, aliases, split_weights, vocabulary)
    else:
        initialize(model)
