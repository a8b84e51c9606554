"""Tensor parallel: Megatron column/row splits on DTensor, sequence parallel, vocab-parallel embedding, loss parallel.

A column-parallel Linear splits its output features over the `tp` ranks, a row-parallel one its input features,
so an attention block (q/k/v column, o row) or an MLP (gate/up column, down row) needs one all-reduce in
forward and one in backward. Sequence parallel turns that all-reduce into a reduce-scatter onto sequence
shards, runs the norms on the shards, and all-gathers before the next column-parallel region.

Plans come from three places: built in for the reference GPT; automatic for common module names
(`q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj` column, `o_proj`/`down_proj` row, GPT-2 style `c_attn`
(fused q/k/v), `c_fc` column and `c_proj` row); or `tensor_parallel.plan` in the config.
"""

from __future__ import annotations

import fnmatch
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshkit.config import TensorParallelConfig
from meshkit.errors import MeshkitError
from meshkit.models.gpt import GPT

AUTO_RULES = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "gate_proj": "colwise",
    "up_proj": "colwise",
    "o_proj": "rowwise",
    "down_proj": "rowwise",
    "c_attn": "fused_qkv",
    "c_fc": "colwise",
    "c_proj": "rowwise",
    "lm_head": "replicate",
}
HEAD_ATTRIBUTES = ("n_heads", "n_head", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")
WIDTH_ATTRIBUTES = ("hidden_size", "n_embd", "embed_dim", "split_size")  # used to reshape local outputs


class TensorParallelError(MeshkitError):
    """A model or plan tensor parallel cannot split; the message says what to change."""


def _valid_sizes(count: int) -> str:
    return ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)


def check_heads(model: nn.Module, tp: int) -> None:
    """tp must divide every head count (query and key/value heads)."""
    counts: dict[str, int] = {}
    if isinstance(model, GPT):
        counts = {"n_heads": model.cfg.n_heads, "n_kv_heads": model.cfg.kv_heads}
    for module in model.modules():
        for attr in HEAD_ATTRIBUTES:
            if isinstance(getattr(module, attr, None), int):
                counts.setdefault(attr, getattr(module, attr))
    for name, count in counts.items():
        if count % tp:
            raise TensorParallelError(f"tp={tp} does not divide {name}={count}: choose tp from {_valid_sizes(count)}")


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


def _style(kind: str) -> ParallelStyle | None:
    return {
        "colwise": ColwiseParallel(),
        "fused_qkv": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "sequence": SequenceParallel(),
    }.get(kind)


def named_plan(model: nn.Module, cfg: TensorParallelConfig) -> dict[str, str]:
    """Module name -> style kind, from the user's patterns or the automatic naming rules."""
    if cfg.plan is not None:  # the first pattern that matches a module name decides its style
        plan = {}
        for name, _ in model.named_modules():
            kind = next((k for pattern, k in cfg.plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
            if name and kind is not None:
                plan[name] = kind
        return plan
    plan, unknown = {}, []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            kind = AUTO_RULES.get(name.rsplit(".", 1)[-1])
            if kind is None:
                unknown.append(name)
            else:
                plan[name] = kind
    if unknown:
        raise TensorParallelError(
            f"the automatic tensor-parallel plan has no rule for Linear layers {unknown[:6]}: give a plan, e.g. "
            "tensor_parallel.plan: {'*.my_proj': colwise, '*.my_out': rowwise, 'head': replicate}"
        )
    return plan


def _interleave_fused_qkv(linear: nn.Linear, tp: int) -> None:
    """Reorder [q; k; v] rows to [q0 k0 v0; q1 k1 v1; ...] so a contiguous column split gives each rank its heads.

    The weights are kept in this order while sharded; `fused_qkv_names` lets the engine restore the original
    order when it gathers the full state dict.
    """
    with torch.no_grad():
        for param in (linear.weight, linear.bias):
            if param is not None:
                param.copy_(interleave_fused_qkv(param, tp))


def interleave_fused_qkv(tensor: torch.Tensor, tp: int) -> torch.Tensor:
    """[q; k; v] rows -> [q0 k0 v0; q1 k1 v1; ...], on a full weight or bias (the order kept while sharded)."""
    rows = tensor.shape[0]
    return tensor.view(3, tp, rows // (3 * tp), *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


def restore_fused_qkv(tensor: torch.Tensor, tp: int) -> torch.Tensor:
    """Inverse of the interleaving, on a full (gathered) weight or bias."""
    rows = tensor.shape[0]
    return tensor.view(tp, 3, rows // (3 * tp), *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


def _divide_attributes(model: nn.Module, tp: int) -> None:
    """Local head counts and widths for attention modules that read them in forward."""
    for module in model.modules():
        children = {name for name, _ in module.named_children()}
        if not children & {"q_proj", "k_proj", "v_proj", "c_attn"}:
            continue
        for attr in (*HEAD_ATTRIBUTES, *WIDTH_ATTRIBUTES):
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                setattr(module, attr, value // tp)


class TensorParallelResult(NamedTuple):
    fused_qkv: list[str]  # names of fused q/k/v weights, stored interleaved (see restore_fused_qkv)
    logits_sharded: bool  # the model returns vocab-sharded DTensor logits: compute the loss under loss_parallel


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, cfg: TensorParallelConfig) -> TensorParallelResult:
    """Split `model` over `tp_mesh` in place."""
    tp = tp_mesh.size()
    check_heads(model, tp)
    if isinstance(model, GPT) and cfg.plan is None:
        root, block = gpt_plan(model, cfg)
        parallelize_module(model, tp_mesh, root)
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, block)
        if cfg.sequence_parallel:
            model.sequence_shards = tp
        return TensorParallelResult([], cfg.loss_parallel)
    if cfg.sequence_parallel:
        raise TensorParallelError(
            "sequence_parallel is built in for the reference GPT only: set sequence_parallel=false for this model"
        )
    kinds = named_plan(model, cfg)
    fused = [name for name, kind in kinds.items() if kind == "fused_qkv"]
    for name in fused:
        _interleave_fused_qkv(model.get_submodule(name), tp)
    styles = {name: style for name, kind in kinds.items() if (style := _style(kind)) is not None}
    parallelize_module(model, tp_mesh, styles)
    _divide_attributes(model, tp)
    return TensorParallelResult([f"{name}.{param}" for name in fused for param in ("weight", "bias")], False)
