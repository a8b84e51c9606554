"""Which linear layers tensor parallel splits and how, from the model's own declaration or from traced facts.

For each attention and MLP of a block (a *region*) the answer is a role per linear layer:
- `column`: reads the region's input, output features split over tp (a fused q/k/v or gate/up layer whose parts
  lie one after the other is marked `fused`, so its rows are regrouped per rank first);
- `row`: writes the region's output, input features split, the partial outputs summed over tp;
- `column_gathered` / `row_of_whole`: a column split whose output is gathered again, and a row split that takes
  its slice of a whole input (transformers' `colwise_gather_output` / `rowwise_split_input`);
- `whole`: kept whole on every rank.

Sources, first that answers: transformers' `base_model_tp_plan` (written by the model's authors; a declared gather
is dropped where meshkit's own mechanisms make it unneeded: a fused layer regrouped per rank, an attention's
whole-projection norms split with its heads), then one traced forward (`forward_trace.py`): the layers that read
the region's input are columns and the one that writes its output is the row, where the region is an attention
the structure layer knows (its heads are divided) or an MLP whose readers reach the writer through element-wise
operations only. A region neither source can prove is kept whole. Mixture-of-experts routers and banks are not
regions here: expert parallelism places them (`experts.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from meshkit.models.adapters import inside_lora_layer, lora_parts
from meshkit.models.blocks import block_units, find_blocks
from meshkit.models.facts import AttentionFacts, ModelStructure, takes_cache_switch
from meshkit.models.forward_trace import ELEMENTWISE, RESHAPING, RegionTrace, trace_regions
from meshkit.models.hf_adapter import text_config

Role = Literal["column", "row", "column_gathered", "row_of_whole", "whole"]
Source = Literal["declared", "traced"]
DECLARED_ROLES: dict[str, Role] = {
    "colwise": "column",
    "packed_colwise": "column",
    "unit_colwise": "column",  # (split by whole heads: MiniCPM5's k/v; fewer heads than ranks is refused in one line)
    "rowwise": "row",
    "packed_rowwise": "row",
    "unit_rowwise": "row",
    "colwise_gather_output": "column_gathered",
    "colwise_rep": "column_gathered",
    "rowwise_split_input": "row_of_whole",
    "rowwise_rep": "row_of_whole",
}
# how a fused output is cut into its parts: one after the other (split/slice: regrouped per rank), or per head
# (viewed as [.., heads, parts, head_dim] first: a plain column split already gives each rank whole heads)
ATTENTION_KERNEL = re.compile(r"ScaledDotProduct|Softmax|FlexAttention|FlashAttention|EfficientAttention")
CUT_IN_PARTS = {"SplitBackward0", "SplitWithSizesBackward0", "SliceBackward0", "ChunkBackward0", "UnbindBackward0"}


@dataclass(frozen=True)
class LayerRole:
    role: Role
    source: Source
    region: str
    fused: Literal["qkv", "gate_up"] | None = None  # parts one after the other, regrouped per rank
    groups: int = 1  # its output is viewed as [..., groups, width / groups] and cut on the last dim (traced)


@dataclass(frozen=True)
class LayerRoles:
    layers: dict[str, LayerRole] = field(default_factory=dict)
    whole_regions: dict[str, str] = field(default_factory=dict)  # region -> why it is kept whole
    unplaced: tuple[str, ...] = ()  # layers of regions with no role: the traced forward failed (`trace_error`)
    trace_error: str = ""
    # traced region -> its parameters outside its layers that the writers' inputs depend on (their gradients are
    # partial over tp); the region's other such parameters get whole gradients (`RegionTrace.between_parameters`)
    between_parameters: dict[str, frozenset[str]] = field(default_factory=dict)

    def partial_gradient(self, name: str) -> bool:
        """Whether parameter `name`, whole inside a split region, gets only part of its gradient on each tp rank
        (True unless a trace of its region shows the split activations never reach it)."""
        regions = [path for path in self.between_parameters if name.startswith(f"{path}.")]
        region = max(regions, key=len, default=None)  # (the innermost: an attention inside a block that is one too)
        return region is None or name in self.between_parameters[region]

    def gathered_attentions(self, attention: tuple[AttentionFacts, ...]) -> set[str]:
        """Attentions whose split projections are gathered again: they run every head on each rank."""
        gathered = {role.region for role in self.layers.values() if role.role == "column_gathered"}
        return {facts.path for facts in attention if facts.path in gathered}

    def whole_between_layers(self) -> set[str]:
        """Regions whose split layers all hand on whole outputs (gathered columns, rows of a whole input: Qwen3-Next's
        linear attention as declared): every rank computes the rest of the region whole, its gradients whole."""
        regions: dict[str, set[str]] = {}
        for role in self.layers.values():
            regions.setdefault(role.region, set()).add(role.role)
        handing_on_whole = {"column_gathered", "row_of_whole"}
        return {
            region
            for region, kinds in regions.items()
            if kinds & handing_on_whole and kinds <= {*handing_on_whole, "whole"}
        }


def linear_layers(module: nn.Module) -> list[str]:
    """Names (relative to `module`) of its linear layers: nn.Linear, GPT-2's Conv1D, a LoRA layer as one."""
    lora = {name for name, child in module.named_modules() if lora_parts(child) is not None}
    return [
        name
        for name, child in module.named_modules()
        if name and not inside_lora_layer(name, lora) and (name in lora or is_linear(child))
    ]


def is_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) or (
        type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
    )


def regions(model: nn.Module, structure: ModelStructure) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
    """path -> (module, full names of its linear layers) for every attention and MLP of the blocks; the block itself
    for linear layers that are its direct children. A mixture-of-experts block's region is its shared expert."""
    if structure.blocks is None:
        return {}
    path, blocks = find_blocks(model, structure.blocks)
    moe = {facts.path: facts.shared for facts in structure.moe}
    out: dict[str, tuple[nn.Module, tuple[str, ...]]] = {}
    for index, block in block_units(blocks):
        block_path = f"{path}.{index}" if path else str(index)
        direct = []
        for name, child in block.named_children():
            child_path = f"{block_path}.{name}"
            if child_path in moe:
                shared = moe[child_path]
                if shared is None:
                    continue
                child_path, child = f"{child_path}.{shared}", child.get_submodule(shared)
            if is_linear(child) or lora_parts(child) is not None:
                direct.append(child_path)
                continue
            layers = tuple(f"{child_path}.{layer}" for layer in linear_layers(child))
            if layers:
                out[child_path] = (child, layers)
        if direct:
            out[block_path] = (block, tuple(direct))
    return out


def declared_plan(model: nn.Module, structure: ModelStructure) -> dict[str, str]:
    """transformers' `base_model_tp_plan` of the model's text config, keyed by full module-name patterns."""
    config = getattr(model, "config", None)
    if config is None or structure.blocks is None:
        return {}
    plan = getattr(text_config(config), "base_model_tp_plan", None) or {}
    base = structure.blocks.rpartition(".")[0]
    return {f"{base}.{key}" if base else key: style for key, style in plan.items()}


def _match(plan: dict[str, str], name: str) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name):
            return style
    return None


def layer_roles(model: nn.Module, structure: ModelStructure, run: Callable[[], Any] | None = None) -> LayerRoles:
    """Each region's layer roles; `run` is one forward of `model` (default: `sample_forward`)."""
    found = regions(model, structure)
    plan = declared_plan(model, structure)
    roles: dict[str, LayerRole] = {}
    whole: dict[str, str] = {}
    undeclared, declared = {}, {}
    for path, (module, layers) in found.items():
        styles = {name: _match(plan, name) for name in layers}
        split_parameters = [name for name, _ in module.named_parameters(prefix=path)
                            if _match(plan, name) in DECLARED_ROLES]  # fmt: skip
        if split_parameters:  # (a parameter split on its own, e.g. a per-head gate bias: meshkit splits layers)
            whole[path] = f"its declared plan splits the parameter {split_parameters[0]}, which meshkit keeps whole"
            roles.update({name: LayerRole("whole", "declared", path) for name in layers})
        elif any(styles.values()):
            roles.update(_declared(path, model, layers, styles, structure))
            declared[path] = (module, layers)
        else:
            undeclared[path] = (module, layers)
    if not undeclared and not declared:
        return LayerRoles(roles, whole)
    try:
        traces = trace_regions(model, {**declared, **undeclared}, run or sample_forward(model, structure))
    except Exception as error:  # noqa: BLE001 - any failure of a forward on sample input: fall back, say why
        unplaced = tuple(name for _, layers in undeclared.values() for name in layers)
        return LayerRoles(roles, whole, unplaced, f"{type(error).__name__}: {error}".split("\n")[0][:200])
    for path, (_, layers) in declared.items():  # (a declaration the forward contradicts: the region stays whole)
        trace = traces.get(path)
        stray = [name for name in layers if roles[name].role.startswith("row") and trace and name not in trace.writers]
        mixing = _mixing(trace) if trace is not None and _attention_of(path, structure) is None else []
        if stray or mixing:
            whole[path] = (
                f"its declared row split {stray[0]} does not write the region's output"
                if stray
                else f"its forward mixes the split features between its layers ({', '.join(mixing)})"
            )
            roles.update({name: LayerRole("whole", "declared", path) for name in layers})
        elif trace is not None:  # (a declared column the forward cuts in groups: CodeGen's q, v, k in 4)
            for name in (name for name in layers if roles[name].role == "column" and name in trace.groups):
                fused = roles[name].fused or _fused(model, name, trace, structure, "column")
                roles[name] = replace(roles[name], fused=fused, groups=trace.groups[name])
    blocks = {id(block) for _, block in block_units(find_blocks(model, structure.blocks)[1])}
    for path, (module, layers) in undeclared.items():
        trace = traces.get(path)
        own_block = id(module) in blocks
        reason = "the traced forward never ran it" if trace is None else _unsplittable(trace, structure, own_block)
        if reason:
            whole[path] = reason
            roles.update({name: LayerRole("whole", "traced", path) for name in layers})
            continue
        assert trace is not None
        latent = _latent_readers(trace)
        for name in layers:  # (a layer the forward never ran stays whole)
            role: Role = "row" if name in trace.writers else "column" if name in trace.called else "whole"
            role = "whole" if name in latent else role
            fused = _fused(model, name, trace, structure, role)
            roles[name] = LayerRole(role, "traced", path, fused, trace.groups.get(name, 1) if role == "column" else 1)
    names = {id(param): name for name, param in model.named_parameters()}
    between = {path: frozenset(names[i] for i in trace.between_parameters if i in names)
               for path, trace in traces.items()}  # fmt: skip
    return LayerRoles(roles, whole, between_parameters=between)


def _attention_of(path: str, structure: ModelStructure) -> AttentionFacts | None:
    return next((facts for facts in structure.attention if facts.path == path), None)


def _unsplittable(trace: RegionTrace, structure: ModelStructure, own_block: bool) -> str:
    """Why the traced region cannot be split on its features ('' when it can)."""
    if trace.output_reads_input and not own_block:  # (a block's own layers: its output adds its input, fine)
        return "its output mixes its input with its layers' result (a gated norm, not an attention or MLP)"
    if len(trace.writers) != 1 or not trace.readers:
        return f"{len(trace.readers)} layer(s) read its input and {len(trace.writers)} write its output (need ≥1 and 1)"
    middle = [name for name in trace.called if name not in trace.readers and name not in trace.writers]
    attention = _attention_of(trace.path, structure)
    chained = attention is not None and all(trace.sources[name] <= set(trace.readers) for name in middle)
    if (middle and not chained) or trace.writers[0] in trace.readers:
        return f"layer(s) {middle or trace.writers} lie between its input and output"
    if attention is not None and not any(ATTENTION_KERNEL.search(name) for name in trace.between):
        return "no softmax attention between its layers (a linear attention or recurrence keeps its own heads)"
    heads = {count for count in (attention.heads, attention.kv_heads) if count} if attention is not None else set()
    if trace.cut_dims & heads:
        return "it cuts its heads into fixed groups (a differential attention pairs one half with the other)"
    if attention is None and not trace.between <= ELEMENTWISE:
        mixing = sorted(trace.between - ELEMENTWISE)[:3]
        return f"it mixes features between its layers ({', '.join(mixing)}) and is no attention with known heads"
    return ""


def _mixing(trace: RegionTrace) -> list[str]:
    """Operations between an MLP's layers that mix its features (Gemma-3n's activation sparsity takes the mean and
    spread of each token's gate features): a declared split of its layers would see only its rank's features."""
    return sorted(trace.between - ELEMENTWISE - RESHAPING)[:3]


def _latent_readers(trace: RegionTrace) -> set[str]:
    """Readers that feed another layer of an attention before its heads (a latent attention's low-rank
    projections, DeepSeek's q_a_proj and kv_a_proj_with_mqa): they stay whole, and the layers they feed are the
    column splits."""
    middle = [name for name in trace.called if name not in trace.readers and name not in trace.writers]
    return {source for name in middle for source in trace.sources[name]}


def _fused(
    model: nn.Module, name: str, trace: RegionTrace, structure: ModelStructure, role: Role
) -> Literal["qkv", "gate_up"] | None:
    """A column layer whose output holds several parts one after the other (cut by split/slice, not per head;
    or inside each of a fixed number of groups that is not the head count: CodeGen's)."""
    if role != "column":
        return None
    attention = _attention_of(trace.path, structure)
    groups = trace.groups.get(name, 1)
    fixed_groups = groups > 1 and attention is not None and groups not in (attention.heads, attention.kv_heads)
    # q, k and v heads one after the other, cut along the heads of [batch, seq, all heads, head_dim]
    heads = (attention.heads or 0) + 2 * (attention.kv_heads or 0) if attention is not None else 0
    head_parts = heads > 0 and trace.head_cuts.get(name) == heads
    if not fixed_groups and not head_parts and not trace.consumers.get(name, set()) & CUT_IN_PARTS:
        return None
    return _fused_by_width(model, name, trace.path, trace.writers[0], structure)


def _fused_by_width(
    model: nn.Module, name: str, region: str, writer: str, structure: ModelStructure
) -> Literal["qkv", "gate_up"] | None:
    """q, k and v in one layer (its width = the query heads' plus twice the key/value heads'), or gate and up in
    one (twice the width the writer reads)."""
    width, written = _features(model.get_submodule(name), "out"), _features(model.get_submodule(writer), "in")
    attention = _attention_of(region, structure)
    if attention is None:
        return "gate_up" if width == 2 * written else None
    if attention.heads and attention.kv_heads and attention.head_dim:
        return "qkv" if width == (attention.heads + 2 * attention.kv_heads) * attention.head_dim else None
    return "qkv" if width == 3 * written else None  # (head size unknown: three equal parts)


def _features(module: nn.Module, side: Literal["in", "out"]) -> int:
    parts = lora_parts(module)
    base = module.get_submodule(parts.base) if parts is not None else module
    weight = base.weight
    assert isinstance(weight, torch.Tensor)
    transposed = type(base).__name__ == "Conv1D"  # (weight stored [in, out])
    return int(weight.shape[(0 if side == "out" else 1) ^ transposed])


def _declared(
    path: str, model: nn.Module, layers: tuple[str, ...], styles: dict[str, str | None], structure: ModelStructure
) -> dict[str, LayerRole]:
    """The declared roles of one region; layers the declaration leaves out stay whole (as transformers does). A
    declared gather becomes a plain split where meshkit regroups the fused layer or splits the projection norms."""
    roles = {name: DECLARED_ROLES.get(style or "", "whole") for name, style in styles.items()}
    writer = next((name for name, role in roles.items() if role in ("row", "row_of_whole")), None)
    fused = {
        name: _fused_by_width(model, name, path, writer, structure) if writer else None
        for name, role in roles.items()
        if role == "column_gathered"
    }
    attention = _attention_of(path, structure)
    explained = all(kind is not None for kind in fused.values()) or bool(attention and attention.projection_norms)
    if fused and explained:
        plain: dict[Role, Role] = {"column_gathered": "column", "row_of_whole": "row"}
        roles = {name: plain.get(role, role) for name, role in roles.items()}
    return {name: LayerRole(role, "declared", path, fused.get(name) if role == "column" else None)
            for name, role in roles.items()}  # fmt: skip


def sample_forward(model: nn.Module, structure: ModelStructure, keep_mode: bool = False) -> Callable[[], Any]:
    """One forward of a few tokens in eval mode (no dropout; `keep_mode`: in the model's own mode, where only the
    graph's structure is read and a switch of mode would have side effects — RWKV rescales its weights on one), on
    the model's device (the meta device included: a transformers model gets a 4-D mask there, so that it builds
    none from the data). A model without an input embedding (a user's own stack) runs each block alone on
    [1, 4, width] hidden states instead."""
    param = next(model.parameters())

    def run() -> Any:
        was_training = model.training
        model.train(was_training and keep_mode)
        try:
            if hasattr(model, "get_input_embeddings") and hasattr(model, "config"):
                ids = torch.zeros(1, 4, dtype=torch.long, device=param.device)
                kwargs: dict[str, Any] = {"use_cache": False} if takes_cache_switch(model) else {}
                if param.device.type == "meta":
                    kwargs["attention_mask"] = torch.zeros(1, 1, 4, 4, device=param.device, dtype=param.dtype)
                return model(input_ids=ids, **kwargs)
            _, blocks = find_blocks(model, structure.blocks)
            for _, block in block_units(blocks):
                block(torch.randn(1, 4, _input_width(block), device=param.device, dtype=param.dtype))
            return None
        finally:
            model.train(was_training)

    return run


def _input_width(block: nn.Module) -> int:
    """The features a block takes: its first parameter's (a norm's weight, or a linear layer's input)."""
    for module in block.modules():
        if is_linear(module):
            return _features(module, "in")
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1 and next(module.children(), None) is None:
            return int(weight.numel())
    raise TypeError(f"{type(block).__name__} has no parameter that tells its input width")
