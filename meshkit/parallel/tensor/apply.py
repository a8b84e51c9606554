"""Tensor parallel: Megatron column/row splits on DTensor, sequence parallel, vocab-parallel embedding, loss parallel.

A column-parallel Linear splits its output features over the `tp` ranks, a row-parallel one its input features,
so an attention block (q/k/v column, o row) or an MLP (gate/up column, down row) needs one all-reduce in
forward and one in backward. Sequence parallel turns that all-reduce into a reduce-scatter onto sequence
shards, runs the norms on the shards, and all-gathers before the next column-parallel region.

The reference GPT has its plan here (vocab-parallel embedding and head, loss parallel); every other model
gets one from its layers' roles or `tensor_parallel.plan` (`auto.py`) and its sequence parallel from
`sequence.py`. Head counts come from the model-structure layer, for the check before anything is split.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshkit.config.layout import choices_text
from meshkit.config.schema import TensorParallelConfig
from meshkit.models.blocks import block_units, find_blocks
from meshkit.models.facts import AttentionFacts
from meshkit.models.gpt import GPT
from meshkit.models.layer_roles import LayerRoles, layer_roles
from meshkit.models.structure import ModelStructure, describe
from meshkit.parallel.tensor.auto import TensorParallelError, divide_attributes, style, tensor_plan
from meshkit.parallel.tensor.first_call import check_first_call
from meshkit.parallel.tensor.groups import check_local_groups, grouped_layout
from meshkit.parallel.tensor.head_inputs import take_own_heads
from meshkit.parallel.tensor.head_parameters import split_head_parameters
from meshkit.parallel.tensor.latent import sum_shared_rotary_key
from meshkit.parallel.tensor.lora import split_lora_layers
from meshkit.parallel.tensor.norms import split_projection_norms
from meshkit.parallel.tensor.sequence import (
    apply_sequence_parallel,
    require_sequence_shape,
    split_regions,
    whole_sequence_children,
)
from meshkit.parallel.tensor.storage import SplitWeights, interleave_in_place


def check_heads(model: nn.Module | ModelStructure, tp: int, ranks: int | None = None) -> None:
    """tp must divide every head count (query and key/value heads); refuses before anything is split, offering the
    sizes that divide the head counts and, when known, the `ranks` tp may span (the world over pp × cp)."""
    structure = model if isinstance(model, ModelStructure) else describe(model)
    if "tp" in structure.notes:
        raise TensorParallelError(f"tensor parallel cannot split this model: {structure.notes['tp']}")
    counts = structure.head_counts()
    wrong = {name: count for name, count in counts.items() if count % tp}
    if wrong:
        shown = ", ".join(f"{name}={count}" for name, count in counts.items())
        fits = [
            d
            for d in range(1, min(counts.values()) + 1)
            if all(count % d == 0 for count in counts.values()) and (ranks is None or ranks % d == 0)
        ]
        raise TensorParallelError(
            f"tp={tp} does not divide the attention's head counts ({shown}): choose tp {choices_text(fits)}"
        )


def gpt_plan(model: GPT, cfg: TensorParallelConfig) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(root plan, per-block plan) for the reference GPT, as torchtitan does for Llama."""
    sp = cfg.sequence_parallel
    hidden = Shard(1) if sp else Replicate()  # layout of the residual stream between TP regions
    root: dict[str, ParallelStyle] = {
        # vocab-parallel embedding: each rank holds a slice of the vocabulary; the partial sums are reduced
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=hidden),
        "output": ColwiseParallel(
            input_layouts=hidden,
            output_layouts=Shard(-1) if cfg.loss_parallel else Replicate(),
            use_local_output=not cfg.loss_parallel,  # loss parallel needs the DTensor of vocab-sharded logits
        ),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=hidden),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=hidden),
    }
    if sp:
        root["norm"] = SequenceParallel()
        block.update(
            {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        )
    return root, block


class TensorParallelResult(NamedTuple):
    split_weights: SplitWeights  # how the fused weights are stored
    logits_sharded: bool  # the model returns vocab-sharded DTensor logits: compute the loss under loss_parallel
    partial_over_tp: list[str] = []  # parameters whose gradients each tp rank holds a part of (summed after backward)
    note: str | None = None  # one line for the user: how the plan was decided, where names decided it


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    cfg: TensorParallelConfig,
    structure: ModelStructure,
    roles: LayerRoles | None = None,
) -> TensorParallelResult:
    """Split `model` over `tp_mesh` in place; `roles`: its layers' roles, learnt on the whole model before a
    pipeline split (default: learnt from `model` here)."""
    tp = tp_mesh.size()
    check_heads(structure, tp)
    if isinstance(model, GPT) and cfg.plan is None:
        root, block = gpt_plan(model, cfg)
        parallelize_module(model, tp_mesh, root)
        for layer in model.layers:
            if not getattr(layer, "is_placeholder", False):
                parallelize_module(layer, tp_mesh, block)
        if cfg.sequence_parallel:
            model.sequence_shards = tp
        return TensorParallelResult(SplitWeights(tp), cfg.loss_parallel)
    if cfg.sequence_parallel and not structure.last_stage:
        raise TensorParallelError(
            f"sequence parallel must gather the sequence before {type(model).__name__}'s head, which meshkit "
            "cannot find: name its final norm and head in structure.last_stage"
        )
    whole = tuple(f"{facts.path}.{facts.router}" for facts in structure.moe)  # (routers, a classifier: replicated)
    if roles is None:
        roles = layer_roles(model, structure) if cfg.plan is None else LayerRoles()
    planned = tensor_plan(model, cfg, roles, whole + ((structure.classifier,) if structure.classifier else ()))
    plan = planned.kinds
    if cfg.sequence_parallel:  # an MoE block runs whole on this rank's sequence shard, shared expert included
        moe = tuple(f"{facts.path}." for facts in structure.moe)  # (it may see the tokens flattened: Qwen2-MoE)
        plan = {name: kind for name, kind in plan.items() if not name.startswith(moe)}
    lora = split_lora_layers(model, plan, cfg.sequence_parallel)
    kinds = lora.kinds
    split_weights = SplitWeights.union(
        (interleave_in_place(model.get_submodule(name), name, tp, fused_parts(name, kind, structure),
                             *grouped_layout(name, roles, structure, tp))
         for name, kind in kinds.items() if kind in ("fused_qkv", "fused_gate_up")),
        tp,
    )  # fmt: skip
    styles = {name: found for name, kind in kinds.items() if (found := style(kind, cfg.sequence_parallel))}
    parallelize_module(model, tp_mesh, styles)
    check_local_groups(model, roles, structure, tp)  # (after the styles' hooks: it reads the local outputs)
    for experts in structure.moe:  # a split shared expert returns a view of the reduced output
        shared = f"{experts.path}.{experts.shared}" if experts.shared else None
        if shared and any(name.startswith(f"{shared}.") for name in styles):
            model.get_submodule(shared).register_forward_hook(_own_output)
    split = _split_attentions(structure, roles, styles)
    for facts in split:
        try:
            attention = model.get_submodule(facts.path)
        except AttributeError:  # the block lives on another pipeline stage
            continue
        divide_attributes(attention, tp)
        check_first_call(attention, facts.path, tp)
        if facts.heads is not None:
            take_own_heads(attention, facts.heads, tp_mesh.get_local_rank(), tp)
    split_projection_norms(model, split, tp_mesh)
    split_head_parameters(model, split, tp_mesh)
    if cfg.sequence_parallel:
        columns = {name for name, kind in kinds.items() if kind in COLUMN_KINDS and name in styles}
        # (a region whose writer is a row split of a whole input hands on its reduce-scattered shard already)
        scattered = {role.region for name, role in roles.layers.items() if kinds.get(name) == "rowwise_of_whole"}
        whole_out = roles.whole_between_layers() - scattered
        apply_sequence_parallel(model, structure, tp_mesh, set(styles), columns, whole_out)
        for name in (name for name, kind in kinds.items() if kind == "rowwise" and name in styles):
            require_sequence_shape(model.get_submodule(name), name)
    latent = sum_shared_rotary_key(model, split, tp_mesh.get_group())
    whole_inside = (*latent, *roles.whole_between_layers())  # (their other parameters' gradients: whole)
    in_regions = [
        name
        for name in unsplit_in_split_regions(model, structure, set(styles))
        if not any(name.startswith(f"{path}.") for path in whole_inside)
        # (under SP one used after the region sees this rank's sequence shard: partial too)
        and (cfg.sequence_parallel or roles.partial_gradient(name))
    ]
    partial = [name for name in in_regions if name not in lora.whole and name not in lora.partial] + lora.partial
    if cfg.sequence_parallel:
        partial += on_sequence_shards(model, structure, set(styles))
    return TensorParallelResult(split_weights, False, partial, planned.note)


COLUMN_KINDS = ("colwise", "colwise_gathered", "fused_qkv", "fused_gate_up")


def _split_attentions(
    structure: ModelStructure, roles: LayerRoles, styles: dict[str, ParallelStyle]
) -> tuple[AttentionFacts, ...]:
    """The attentions whose heads are split over tp: some layer of theirs is split and its output is not gathered
    again (a gathered or whole attention runs every head on each rank, its head counts untouched)."""
    gathered = roles.gathered_attentions(structure.attention)
    return tuple(
        facts
        for facts in structure.attention
        if facts.path not in gathered and any(name.startswith(f"{facts.path}.") for name in styles)
    )


def _own_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """A copy of a split shared expert's output: the view torch's row split returns cannot be added to in place,
    and a MoE block may do so (Llama 4 adds the routed experts' output into it)."""
    return output.clone()


def fused_parts(name: str, kind: str, structure: ModelStructure) -> tuple[int, ...] | int:
    """A fused layer's parts: q, k and v sized by its attention's head counts (unequal under GQA: Phi-3's
    qkv_proj), else how many equal parts (3: GPT-2's c_attn; 2: a fused gate/up)."""
    if kind == "fused_gate_up":
        return 2
    attention = next((facts for facts in structure.attention if name.startswith(f"{facts.path}.")), None)
    if attention is None or attention.heads is None or attention.kv_heads is None or attention.head_dim is None:
        return 3
    q, kv = attention.heads * attention.head_dim, attention.kv_heads * attention.head_dim
    return 3 if q == kv else (q, kv, kv)


def unsplit_in_split_regions(model: nn.Module, structure: ModelStructure, split_modules: set[str]) -> list[str]:
    """Parameters left whole inside an attention or MLP whose layers are split, e.g. Qwen3's and Gemma3's
    per-head q/k norms: each tp rank computes their gradient from its own heads only, so the parts are summed.
    (In a mixture-of-experts block the region is its shared expert: the router, expert bank and shared-expert
    gate see the whole input on every tp rank without sequence parallel, so their gradients are whole.)"""
    return [
        f"{name}.{param_name}"
        for name, region in split_regions(model, structure, split_modules)
        for param_name, param in region.named_parameters()
        if not isinstance(param, DTensor)
    ]


def on_sequence_shards(model: nn.Module, structure: ModelStructure, split_modules: set[str]) -> list[str]:
    """Under sequence parallel, the whole parameters of the blocks outside the split attentions and MLPs and the
    children run on the whole sequence (and not sequence-parallel norms): every MoE block, which runs token by
    token on this rank's sequence shard, and any other layer a block applies to its hidden states; each rank holds
    part of their gradients."""
    if structure.blocks is None:
        return []
    _, blocks = find_blocks(model, structure.blocks)
    names = {id(param): name for name, param in model.named_parameters()}
    regions = [f"{name}." for name, _ in split_regions(model, structure, split_modules)]
    regions += [f"{name}." for name, _ in whole_sequence_children(model, structure, split_modules)]
    out = []
    for _, block in block_units(blocks):
        for param in block.parameters():
            name = names[id(param)]
            if not isinstance(param, DTensor) and not name.startswith(tuple(regions)):
                out.append(name)
    return out
