"""Sequence parallel for any block-structured model (the reference GPT has its own plan in `apply.py`).

Between the tensor-parallel regions each rank keeps seq / tp positions of the residual stream: the blocks'
norms run on those sequence shards, each attention or MLP all-gathers its input first, and its row-parallel
output is reduce-scattered back onto the shards. The model's own forward still sees the whole sequence
before the first block, so what it computes there (rotary tables, masks, position embeddings) is unchanged;
the first block's input is cut into shards and gathered again before the final norm. A pipeline stage cuts
before its first block and gathers after its last, so stages hand each other whole hidden states.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from meshkit.models.blocks import block_units, find_blocks, is_placeholder
from meshkit.models.structure import ModelStructure
from meshkit.parallel.tensor.auto import TensorParallelError


def acts_per_token(module: nn.Module) -> bool:
    """A block's child with weights that are all one value per feature (a norm of any class: torch's, Nemotron's
    `LayerNorm1P`, a user's own): it acts on each token alone, so it runs on sequence shards as it is."""
    params = list(module.parameters())
    return bool(params) and all(param.dim() == 1 for param in params)


class EveryInputSequenceParallel(SequenceParallel):
    """torch's SequenceParallel for a per-token module that takes more than one input shaped like its first (Ergo's
    residual gate: the branch and the residual): every such input is taken as this rank's sequence shard, where
    torch's own hands the module its first input only."""

    @staticmethod
    def _prepare_input_fn(sequence_sharding: Any, mod: nn.Module, inputs: Any, device_mesh: DeviceMesh) -> Any:
        first = inputs[0]
        prepare = SequenceParallel._prepare_input_fn
        shaped = [isinstance(value, torch.Tensor) and value.shape == first.shape for value in inputs]
        return tuple(prepare(sequence_sharding, mod, (value,), device_mesh) if same else value
                     for value, same in zip(inputs, shaped, strict=True))  # fmt: skip


def _owners(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """The modules under `module` that hold its parameters themselves: the module, or the norms of a container
    (LongCat-Flash's two input norms in one `ModuleList`), each called on its own."""
    if next(module.parameters(recurse=False), None) is not None or not list(module.children()):
        return [(path, module)]
    return [found for name, child in module.named_children() for found in _owners(child, f"{path}.{name}")]


def _relayout(tensor: torch.Tensor, mesh: DeviceMesh, source: Placement, target: Placement) -> torch.Tensor:
    return DTensor.from_local(tensor, mesh, [source], run_check=False).redistribute(mesh, [target]).to_local()


def _relayout_hook(mesh: DeviceMesh, source: Placement, target: Placement) -> Any:
    """A forward pre-hook that changes the layout of the hidden states (first argument or `hidden_states=`)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if args and isinstance(args[0], torch.Tensor):
            return (_relayout(args[0], mesh, source, target), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": _relayout(kwargs["hidden_states"], mesh, source, target)}
        raise TypeError(f"{type(module).__name__} got no hidden states to re-lay out for sequence parallel")

    return hook


def apply_sequence_parallel(
    model: nn.Module,
    structure: ModelStructure,
    mesh: DeviceMesh,
    split_modules: set[str],
    columns: set[str],
    whole_out: Collection[str] = (),
) -> None:
    """Sequence-shard the residual stream of `model`, whose `split_modules` are already column/row split
    (`columns`: the column-split ones; `whole_out`: regions whose split layers hand on whole outputs, so the
    region returns the whole sequence and keeps this rank's shard after, like a whole-sequence child)."""
    _, blocks = find_blocks(model, structure.blocks)
    gather = _relayout_hook(mesh, Shard(1), Replicate())
    units = list(block_units(blocks))
    names = {id(module): name for name, module in model.named_modules()}
    for index, block in units:
        for name, child in block.named_children():
            if names[id(child)] in columns:  # a block's own column layer (BioGPT's fc1): gathered before it
                child.register_forward_pre_hook(gather, with_kwargs=True, prepend=True)  # (before its split)
                require_sequence_shape(child, names[id(child)])  # (first: OPT flattens the tokens before fc1)
            elif acts_per_token(child):
                for path, norm in _owners(child, f"{structure.blocks}.{index}.{name}"):
                    parallelize_module(norm, mesh, EveryInputSequenceParallel(use_local_output=True))
                    require_sequence_shape(norm, path)
    for name, region in split_regions(model, structure, split_modules):
        region.register_forward_pre_hook(_gather_input(mesh), with_kwargs=True)
        if name in whole_out:  # (Qwen3-Next's linear attention as declared: gathered layers only)
            region.register_forward_hook(_sharded_output(mesh))
    for _, child in whole_sequence_children(model, structure, split_modules):
        child.register_forward_pre_hook(_gather_all(mesh), with_kwargs=True)
        child.register_forward_hook(_sharded_output(mesh))
    present = [block for _, block in units if not is_placeholder(block)]
    if present:  # hidden states arrive whole (from the model's own forward, or the previous pipeline stage)
        present[0].register_forward_pre_hook(_relayout_hook(mesh, Replicate(), Shard(1)), with_kwargs=True)
    for block in present:  # (after the cut above: Gemma-4's per-layer inputs, used on the block's own shard)
        block.register_forward_pre_hook(_side_inputs_sharded(mesh, lowest_dim=3, floats_only=True), with_kwargs=True)
    for facts in structure.moe:  # an MoE block runs on the shard: its routing inputs too (DeepSeek-V4's token ids)
        moe_block = _present(model, facts.path)
        if moe_block is not None:
            moe_block.register_forward_pre_hook(_side_inputs_sharded(mesh, 2, floats_only=False), with_kwargs=True)
    if present:
        # and leave whole: to the next pipeline stage, or to the model's code after its blocks, which may reshape
        # them to the whole sequence (OpenAI GPT before its head, GPT-2 after its final norm)
        present[-1].register_forward_hook(_gathered_output(mesh))


class _SequenceShaped:
    """A forward pre-hook (first of the module's): its input must be [batch, seq, features], split on dim 1."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() < 3:
            raise TensorParallelError(
                f"sequence parallel: {self.name} gets tokens flattened to {tuple(args[0].shape)} by the model, so "
                "they cannot be split on the sequence: set tensor_parallel.sequence_parallel: false"
            )


def require_sequence_shape(module: nn.Module, name: str) -> None:
    """Refuse, in one line, a sequence-parallel module that the model feeds flattened tokens (OPT's MLP)."""
    module.register_forward_pre_hook(_SequenceShaped(name), prepend=True)


def _present(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:  # (on another pipeline stage)
        return None


def _side_inputs_sharded(mesh: DeviceMesh, lowest_dim: int, floats_only: bool) -> Any:
    """A forward pre-hook that cuts the module's other per-token inputs (tensors of `lowest_dim` or more dims,
    [batch, whole sequence, ...]) to this rank's sequence shard, as its hidden states (the first) already are.
    A block takes only float ones of 3 dims or more this way: 2-D positions and integer indices (an indexer's
    top-k) go on to the split attention, which gathers the sequence."""
    size = mesh.size()

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            return args, kwargs
        whole = (hidden.shape[0], hidden.shape[1] * size)

        def shard(value: Any) -> Any:
            per_token = isinstance(value, torch.Tensor) and value is not hidden and value.dim() >= lowest_dim
            per_token = per_token and tuple(value.shape[:2]) == whole and (value.is_floating_point() or not floats_only)
            return _relayout(value, mesh, Replicate(), Shard(1)) if per_token else value

        return tuple(shard(value) for value in args), {key: shard(value) for key, value in kwargs.items()}

    return hook


def _gathered_output(mesh: DeviceMesh) -> Any:
    """A forward hook that gathers a block's output (a tensor, or a tuple or list led by one) from sequence shards."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return _relayout(output, mesh, Shard(1), Replicate())
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            gathered = (_relayout(output[0], mesh, Shard(1), Replicate()), *output[1:])
            return list(gathered) if isinstance(output, list) else gathered
        raise TypeError(f"{type(module).__name__} returned no hidden states to gather for sequence parallel")

    return hook


def whole_sequence_children(
    model: nn.Module, structure: ModelStructure, split_modules: set[str]
) -> list[tuple[str, nn.Module]]:
    """(name, module) of each block child with weights that is neither split, nor acting on each token alone (a
    norm), nor a mixture-of-experts block (token by token): it may mix tokens (a linear attention, a recurrence,
    a convolution kept whole), so it runs on the whole sequence — gathered before, this rank's shard kept after —
    and its gradients are whole on every rank."""
    if structure.blocks is None:
        return []
    _, blocks = find_blocks(model, structure.blocks)
    names = {id(module): name for name, module in model.named_modules()}
    split = {name for name, _ in split_regions(model, structure, split_modules)}
    moe = {facts.path for facts in structure.moe}
    out = []
    for _, block in block_units(blocks):
        for child in block.children():
            name = names[id(child)]
            if name in split or name in moe or name in split_modules or acts_per_token(child):
                continue
            if any(split_name.startswith(f"{name}.") for split_name in split_modules):
                continue  # (an MoE block's split shared expert, a region holding split layers)
            if next(child.parameters(), None) is not None:
                out.append((name, child))
    return out


def _gather_input(mesh: DeviceMesh) -> Any:
    """A forward pre-hook that gathers a split region's input from sequence shards: its first hidden-state
    argument, wherever the model passes that same tensor again (CTRL hands it in as q, k and v); another
    tensor (Bloom's residual, added to the row layer's sharded output) stays on its shard."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"{type(module).__name__} got no hidden states to gather for sequence parallel")
        whole = _relayout(first, mesh, Shard(1), Replicate())
        return (tuple(whole if value is first else value for value in args),
                {key: whole if value is first else value for key, value in kwargs.items()})  # fmt: skip

    return hook


def _gather_all(mesh: DeviceMesh) -> Any:
    """A forward pre-hook that gathers every hidden-state argument (the tensors shaped like the first one: BERT's
    output layer takes its input and the residual) from sequence shards."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() >= 3), None)
        if first is None:
            raise TypeError(f"{type(module).__name__} got no hidden states to gather for sequence parallel")
        shape = first.shape

        def whole(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[:2] == shape[:2]:
                return _relayout(value, mesh, Shard(1), Replicate())
            return value

        return tuple(whole(v) for v in args), {key: whole(v) for key, v in kwargs.items()}

    return hook


def _sharded_output(mesh: DeviceMesh) -> Any:
    """A forward hook that keeps this rank's sequence shard of a block child's whole-sequence output: the tensor,
    or every tensor of a tuple shaped [batch, seq, ...] like the first (DeepSeek-V4's hyper-connection returns its
    per-token weights beside the collapsed hidden states)."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return _relayout(output, mesh, Replicate(), Shard(1))
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) and output[0].dim() >= 2:
            tokens = output[0].shape[:2]

            def shard(value: Any) -> Any:
                per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == tokens
                return _relayout(value, mesh, Replicate(), Shard(1)) if per_token else value

            return tuple(shard(value) for value in output)
        raise TypeError(f"{type(module).__name__} returned no hidden states to shard for sequence parallel")

    return hook


def split_regions(model: nn.Module, structure: ModelStructure, split_modules: set[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of each block child holding column/row-split layers: the attentions and MLPs. In a
    mixture-of-experts block only its shared expert is split (the router and expert bank stay whole, token by
    token): the shared expert is the region."""
    if structure.blocks is None:
        return []
    _, blocks = find_blocks(model, structure.blocks)
    names = {id(module): name for name, module in model.named_modules()}
    moe = {facts.path: facts.shared for facts in structure.moe}
    regions = []
    for _, block in block_units(blocks):
        for child in block.children():
            name = names[id(child)]
            if name in moe:  # only its shared expert, if it has one
                shared = moe[name]
                if shared is None:
                    continue
                name, child = f"{name}.{shared}", child.get_submodule(shared)
            if any(split.startswith(name + ".") for split in split_modules):
                regions.append((name, child))
    return regions
