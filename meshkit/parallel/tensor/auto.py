"""Tensor parallel for any model: plans from the layers' roles, Linear and transposed (`Conv1D`) layers, fused q/k/v.

Plans come from `tensor_parallel.plan`, else from each layer's role as the structure layer learns it (the
model's declared plan, or one traced forward: `models/layer_roles.py`); a table of layer names is only the
fallback where the forward cannot be traced, and says so. GPT-2's `Conv1D` stores its weight [in, out], the
transpose of `nn.Linear`: its column split is dim 1 of the weight, its row split dim 0.
"""

from __future__ import annotations

import fnmatch
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from meshkit.config.schema import TensorParallelConfig
from meshkit.core.errors import MeshkitError
from meshkit.models.layer_roles import LayerRoles, linear_layers

# the fallback where the model's forward cannot be traced: a layer's role by its name
NAME_RULES = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "gate_proj": "colwise",
    "up_proj": "colwise",
    "o_proj": "rowwise",
    "down_proj": "rowwise",
    "c_attn": "fused_qkv",
    "qkv_proj": "fused_qkv",  # Phi-3 (q, k and v of unequal sizes under GQA)
    "gate_up_proj": "fused_gate_up",  # Phi-3, GLM-4
    "c_fc": "colwise",
    "c_proj": "rowwise",
    "out_proj": "rowwise",  # OPT, GPT-J: the attention output
    "fc1": "colwise",  # OPT
    "fc2": "rowwise",
    "fc_in": "colwise",  # GPT-J
    "fc_out": "rowwise",
    "input_linear": "fused_gate_up",  # GraniteMoE-Shared's shared MLP (its experts' are 3-D banks, not Linear)
    "output_linear": "rowwise",
    "lm_head": "replicate",
    "shared_expert_gate": "replicate",  # Qwen2-MoE: one gate value per token for its shared expert
    # DeepSeek's latent attention: the low-rank projections stay whole, the per-head ones from them are split
    "q_a_proj": "replicate",
    "q_b_proj": "colwise",
    "kv_a_proj_with_mqa": "replicate",
    "kv_b_proj": "colwise",
}
WIDTH_ATTRIBUTES = (
    "num_heads",
    "n_head",
    "n_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "hidden_size",
    "n_embd",
    "embed_dim",
    "split_size",
)


class TensorParallelError(MeshkitError):
    """A model or plan tensor parallel cannot split; the message says what to change."""


def is_transposed_linear(module: nn.Module) -> bool:
    """GPT-2 style `Conv1D`: y = x @ W + b with W stored [in, out]."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], source: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param, mesh, [placements[name]], src_data_rank=source)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


def _split_transposed(
    style: ColwiseParallel | RowwiseParallel, module: nn.Module, mesh: DeviceMesh, layout: dict[str, Placement]
) -> nn.Module:
    """Distribute a `Conv1D`'s parameters by `layout`, with `style`'s input and output hooks."""
    return distribute_module(
        module,
        mesh,
        lambda _name, mod, device_mesh: _distribute(mod, device_mesh, layout, style.src_data_rank),
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class Colwise(ColwiseParallel):
    """Column split of an `nn.Linear` or a `Conv1D` (weight dim 1, bias dim 0)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_transposed_linear(module):
            return super()._apply(module, device_mesh)
        return _split_transposed(self, module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})


class Rowwise(RowwiseParallel):
    """Row split of an `nn.Linear` or a `Conv1D` (weight dim 0, bias replicated)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_transposed_linear(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # the input's features are split, as for a row-split Linear
        return _split_transposed(self, module, device_mesh, {"weight": Shard(0), "bias": Replicate()})


def style(kind: str, sequence_parallel: bool) -> ParallelStyle | None:
    """The torch style for a plan kind; under sequence parallel row outputs are reduce-scattered on the sequence."""
    if kind in ("colwise", "fused_qkv", "fused_gate_up"):
        return Colwise()
    if kind == "colwise_gathered":  # the output gathered again: the layers after it see every feature
        return Colwise(output_layouts=Replicate())
    if kind in ("rowwise", "rowwise_of_whole"):  # (of a whole input: each rank takes its slice, no communication)
        inputs = Replicate() if kind == "rowwise_of_whole" else Shard(-1)
        return Rowwise(input_layouts=inputs, output_layouts=Shard(1) if sequence_parallel else Replicate())
    if kind == "sequence":
        return SequenceParallel(use_local_output=True)
    return None


ROLE_KINDS = {
    "column": "colwise",
    "row": "rowwise",
    "column_gathered": "colwise_gathered",
    "row_of_whole": "rowwise_of_whole",
    "whole": "replicate",
}
FUSED_KINDS = {"qkv": "fused_qkv", "gate_up": "fused_gate_up"}


class TensorPlan(NamedTuple):
    kinds: dict[str, str]  # module name -> style kind
    by_name: list[str]  # layers placed by the name table, a fallback: the model's forward could not be traced
    note: str | None = None  # one line for the user when names decided


def tensor_plan(
    model: nn.Module, cfg: TensorParallelConfig, roles: LayerRoles, whole: tuple[str, ...] = ()
) -> TensorPlan:
    """Module name -> style kind: the user's patterns, else each layer's role (declared by the model or traced,
    `models/layer_roles.py`); the name table only for layers of regions the trace could not reach. Linear layers
    outside every attention and MLP (the head, a tower, a router), or at or under a name in `whole` (MoE routers, a
    classifier), are replicated."""
    if cfg.plan is not None:  # the first pattern that matches a module name decides its style
        plan: dict[str, str] = {}
        for name, _ in model.named_modules():
            kind = next((k for pattern, k in cfg.plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
            if name and kind is not None:
                plan[name] = kind
        return TensorPlan(plan, [])
    kinds: dict[str, str] = {}
    by_name: list[str] = []
    unknown: list[str] = []
    for name in linear_layers(model):
        role = roles.layers.get(name)
        if any(name == prefix or name.startswith(f"{prefix}.") for prefix in whole):
            kinds[name] = "replicate"
        elif role is not None:
            kinds[name] = FUSED_KINDS[role.fused] if role.fused else ROLE_KINDS[role.role]
        elif name in roles.unplaced:
            found = NAME_RULES.get(name.rsplit(".", 1)[-1])
            (unknown if found is None else by_name).append(name)
            if found is not None:
                kinds[name] = found
        else:
            kinds[name] = "replicate"
    if unknown:
        raise TensorParallelError(
            f"tensor parallel could not trace {type(model).__name__}'s forward ({roles.trace_error}) and has no "
            f"name rule for its layers {unknown[:4]}: give a plan, e.g. "
            "tensor_parallel.plan: {'*.my_proj': colwise, '*.my_out': rowwise, 'head': replicate}"
        )
    note = None
    if by_name:
        note = (
            f"meshkit: tensor parallel placed {len(by_name)} layer(s) by their names (e.g. {by_name[0]}), as its "
            f"trace of the forward failed ({roles.trace_error}); set tensor_parallel.plan to decide"
        )
    return TensorPlan(kinds, by_name, note)


def divide_attributes(module: nn.Module, tp: int) -> None:
    """Local head counts and widths for an attention module that reads them in forward (e.g. GPT-2's split);
    one that reads them from the model's config (Phi-3's qkv split) gets a copy of it with the local counts."""
    for attr in WIDTH_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
            setattr(module, attr, value // tp)
    config = getattr(module, "config", None)
    if config is not None and isinstance(getattr(config, "num_attention_heads", None), int):
        heads = {
            attr: value // tp
            for attr in ("num_attention_heads", "num_key_value_heads")
            if isinstance(value := getattr(config, attr, None), int) and value % tp == 0
        }
        setattr(module, "config", LocalHeads(config, heads))  # noqa: B010 - (a plain attribute, not a submodule)


class LocalHeads:
    """The model's config as one tensor-parallel rank's attention sees it: its own head counts, and every other
    attribute read from (and written to) the model's config, so later changes (the attention implementation
    context parallel selects) still reach it. The model's config, and what an export writes, keep whole counts."""

    def __init__(self, config: Any, heads: dict[str, int]) -> None:
        # (kept in the instance's __dict__ and read from it: dynamo traces that, not type.__getattribute__, so a
        # compiled block reads its config without a graph break)
        self.__dict__["_config"] = config
        self.__dict__["_heads"] = heads

    def __getattr__(self, name: str) -> Any:
        heads, config = self.__dict__.get("_heads"), self.__dict__.get("_config")
        if heads is None or config is None:  # (a copy being made: not set up yet)
            raise AttributeError(name)
        return heads[name] if name in heads else getattr(config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["_config"], name, value)
