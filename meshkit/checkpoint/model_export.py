"""Full weights out as Hugging Face style safetensors shards, from a live engine or from a saved checkpoint.

Both stream: the shard plan is made from names, shapes and dtypes alone, then the tensors are produced one
at a time in plan order and each shard is written as soon as it is complete. The writer (the main process)
holds at most one output shard besides its own local pieces; other ranks hold one full tensor at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.checkpoint.directory import resolve_resume
from meshkit.checkpoint.storage import CheckpointError, load_tensors, stored_shapes
from meshkit.core.io import ShardStream, TensorInfo, parse_size, plan_shards, storage_identity
from meshkit.models.adapters import (
    LoraMerge,
    base_checkpoint_name,
    is_adapter_parameter,
    is_original_module_copy,
    merged_weight,
)
from meshkit.models.quantized import is_bookkeeping, quantized_weights
from meshkit.parallel.compose import unwrap
from meshkit.parallel.tensor.storage import SplitWeights
from meshkit.runtime import collectives
from meshkit.runtime.mesh import ParallelMesh


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict without aliases (tied weights keep their first name), and without a quantized
    weight's bookkeeping (the weight is dequantized as it is exported)."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    out = {}
    for name, tensor in unwrap(model).state_dict().items():
        if is_bookkeeping(name):
            continue
        if not isinstance(tensor, DTensor):
            identity = storage_identity(tensor)
            if identity in seen:
                continue
            seen.add(identity)
        out[name] = tensor
    return out


def _exported_names(local: dict[str, torch.Tensor], merges: dict[str, LoraMerge], skip: set[str]) -> dict[str, str]:
    """Exported name -> local name: adapter weights are folded into their base weights, a wrapped layer's
    tensors take their base names (a saved module's trained copy, not its frozen original); `skip` (tied copies on
    another pipeline stage) is left out."""
    if not merges:
        return {name: name for name in local if name not in skip}
    return {
        base_checkpoint_name(name): name
        for name in local
        if not (is_adapter_parameter(name) or is_original_module_copy(name)) and name not in skip
    }


def save_model_weights(
    model: nn.Module,
    mesh: ParallelMesh,
    split_weights: SplitWeights,
    out_dir: str | os.PathLike[str],
    max_shard_size: int | str,
    merges: dict[str, LoraMerge] | None = None,
    aliases: dict[str, str] | None = None,
) -> Path:
    """Collective: every rank calls it; rank 0 writes `out_dir`. Returns the index path.

    With `merges` (LoRA layers), each adapted weight is written merged (base + scaling · B @ A) under the base
    model's name (a wrapped layer's other tensors too), and the adapter weights themselves are left out: the result
    loads into the base model class. `aliases`: tied copies, left out (their group is written once).
    """
    local = _local_tensors(model)
    merges = merges or {}
    exported = _exported_names(local, merges, set(aliases or {}))
    quantized = quantized_weights(unwrap(model))  # exported dequantized: their unquantized shape and dtype

    def shape_and_dtype(name: str) -> tuple[tuple[int, ...], str]:
        if name in quantized:
            return quantized[name].checkpoint_shape, str(quantized[name].dtype)
        return tuple(local[name].shape), str(local[name].dtype)

    mine = [(out, *shape_and_dtype(name)) for out, name in exported.items()]
    pp = mesh.size("pp")
    stages = collectives.gather_object(mine, mesh.group("pp")) if pp > 1 else [mine]
    stage_of_rank = collectives.gather_object(mesh.coordinate("pp"), None) if pp > 1 else [0]
    leads = {stage: stage_of_rank.index(stage) for stage in range(pp)}
    owner: dict[str, int] = {}
    infos = []
    for stage, entries in enumerate(stages):
        for name, shape, dtype in entries:
            if name not in owner:
                owner[name] = stage
                infos.append(TensorInfo(name, shape, _dtype(dtype)))
    plan = plan_shards(infos, parse_size(max_shard_size))
    rank, my_stage = (dist.get_rank() if dist.is_initialized() else 0), mesh.coordinate("pp")
    stream = ShardStream(out_dir, plan) if rank == 0 else None

    def full(name: str) -> torch.Tensor:  # collective over the tensor's mesh when it is sharded
        tensor = local[name]
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        if name in quantized:
            return quantized[name].dequantize(whole)
        return split_weights.to_canonical(name, whole)

    for shard in plan:
        for info in shard:
            stage = owner[info.name]
            tensor = None
            if stage == my_stage:
                tensor = full(exported[info.name])
                merge = merges.get(info.name)
                if merge is not None:
                    magnitude = full(merge.magnitude) if merge.magnitude else None
                    tensor = merged_weight(tensor, full(merge.a), full(merge.b), merge, magnitude)
                if exported[info.name] in quantized:  # (merged in the quantized layer's layout first)
                    tensor = quantized[exported[info.name]].as_checkpoint(tensor)
                if rank == leads[stage] and rank != 0:
                    dist.send(tensor.to("cpu").contiguous(), dst=0)
            elif rank == 0:
                tensor = torch.empty(info.shape, dtype=info.dtype)
                dist.recv(tensor, src=leads[stage])
            if stream is not None and tensor is not None:
                stream.add(info.name, tensor)
    index = stream.close() if stream is not None else Path(out_dir) / "model.safetensors.index.json"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return index


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    max_shard_size: int | str = "2GB",
    model: int = 0,
) -> Path:
    """A `save_state` checkpoint (or a checkpoint root: its newest good one) -> safetensors shards + index.

    One process, no process group; reads one output shard's tensors at a time.
    """
    source = resolve_resume(str(checkpoint), Path(checkpoint), label="checkpoint")
    assert source is not None  # a path is never "never" or "auto"
    prefix = "model." if model == 0 else f"model{model}."
    stored = stored_shapes(source)
    infos = [
        TensorInfo(key[len(prefix) :], tuple(shape), dtype)
        for key, (shape, dtype) in stored.items()
        if key.startswith(prefix)
    ]
    if not infos:
        raise CheckpointError(f"checkpoint {source} holds no weights of model {model}")
    stream = ShardStream(out_dir, plan_shards(infos, parse_size(max_shard_size)))
    for shard in stream.plan:
        targets = {prefix + info.name: torch.empty(info.shape, dtype=info.dtype) for info in shard}
        load_tensors(targets, source, None, alone=True)
        for info in shard:
            stream.add(info.name, targets.pop(prefix + info.name))
    return stream.close()
