"""Mixture-of-experts blocks, recognised by their shape: a router and a bank of expert MLPs side by side.

An MoE block is a module with two children: an expert bank — one module whose own parameters are 3-D with the
experts first (transformers 5 fuses them: `experts.gate_up_proj` [E, 2·I, H], `experts.down_proj` [E, H, I];
biases beside them are [E, out]), or
a ModuleList of E alike expert MLPs — and a router whose one weight matrix has a row per expert ([E, H]; its own
or a Linear's inside it). A child named `shared_expert(s)` or `shared_mlp` is the MLP every token also passes
through (DeepSeek, Qwen2-MoE, HunYuan). Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V2/V3 and gpt-oss all read this way, and so does a user's own model built alike; nothing here is keyed
on a family name. Top-k comes from the router or block (`top_k`), else the model config; the load-balancing
loss from the config (`router_aux_loss_coef`, switched on by `output_router_logits`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from meshkit.models.adapters import wrapped_module
from meshkit.models.facts import ExpertFacts, RouterLoss

TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "moe_top_k", "num_selected_experts", "moe_topk")
SHARED_NAMES = ("shared_expert", "shared_mlp")  # (DeepSeek, Qwen2-MoE; HunYuan)
ROUTER_LOSS_COEFFICIENT = "router_aux_loss_coef"
ROUTER_LOSS_SWITCH = "output_router_logits"


def _int_attribute(owner: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _bank_size(name: str, module: nn.Module) -> tuple[int, bool] | None:
    """(experts, fused) when `module` (the child `name`) is an expert bank, else None. A list of modules counts
    only under an expert's name (`experts`, `local_experts`): a model's own list of blocks beside a head with
    one row per block is not a mixture of experts. A bank under peft's adapters is read through them."""
    module = wrapped_module(module)
    if isinstance(module, nn.modules.conv._ConvNd):  # (a convolution's 3-D weight is a kernel: Qwen3.5's conv1d)
        return None
    own = [param for _, param in module.named_parameters(recurse=False)]
    stacked = own and all(param.dim() >= 2 for param in own) and any(param.dim() == 3 for param in own)
    if stacked:  # (gpt-oss: 2-D biases [E, out] beside them; LongCat's gate/up also holds rows for its
        experts = max(param.shape[0] for param in own)  # zero-computation experts, its down projection not)
        return (experts, True) if experts >= 2 else None
    if isinstance(module, nn.ModuleList) and len(module) >= 2 and "expert" in name:
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and all(next(child.parameters(), None) is not None for child in module):
            return len(module), False
    return None


def _router(block: nn.Module, bank: str, experts: int) -> str | None:
    """The child whose one weight matrix has a row per expert: its own (`gate.weight`) or one Linear's inside it
    (HunYuan's `gate.wg`)."""
    for name, child in block.named_children():
        if name == bank:
            continue
        weight = getattr(child, "weight", None)
        rows = [param for param in child.parameters() if param.dim() == 2 and param.shape[0] == experts]
        if (isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] == experts) or len(rows) == 1:
            return name
    return None


def moe_block(path: str, block: nn.Module, config: Any = None) -> ExpertFacts | None:
    """The facts of `block` if it is a mixture-of-experts block."""
    for bank, child in block.named_children():
        found = _bank_size(bank, child)
        if found is None:
            continue
        experts, fused = found
        router = _router(block, bank, experts)
        if router is None:
            continue
        router_module = getattr(block, router)
        top_k = _int_attribute(router_module, TOP_K_ATTRIBUTES) or _int_attribute(block, TOP_K_ATTRIBUTES)
        top_k = top_k or _int_attribute(config, TOP_K_ATTRIBUTES)
        shared = next((name for name, _ in block.named_children() if name.startswith(SHARED_NAMES)), None)
        parameters = tuple(f"{bank}.{name}" for name, _ in child.named_parameters())
        adapted = wrapped_module(child) is not child
        rows = {param.shape[0] for param in wrapped_module(child).parameters(recurse=False)} if fused else set()
        uneven = len(rows) > 1
        return ExpertFacts(path, router, bank, experts, top_k, fused, parameters, shared, adapted, uneven)
    return None


def moe_blocks(model: nn.Module, config: Any = None) -> list[ExpertFacts]:
    """Every MoE block inside `model` (a whole model or one pipeline stage of it), paths relative to `model`."""
    found = (moe_block(name, module, config) for name, module in model.named_modules())
    return [facts for facts in found if facts is not None]


def expert_banks(model: nn.Module) -> set[int]:
    """ids of the modules that are an MoE block's expert bank (never a list of repeated blocks)."""
    banks = set()
    for _, module in model.named_modules():
        facts = moe_block("", module)
        if facts is not None:
            banks.add(id(wrapped_module(module.get_submodule(facts.bank))))
    return banks


def describe_experts(
    blocks_path: str, units: Iterable[tuple[int, nn.Module]], config: Any = None
) -> tuple[ExpertFacts, ...]:
    """Every MoE block inside the repeated blocks (`block_units`), in order (a model may mix dense and MoE)."""
    found = []
    for index, unit in units:
        for name, module in unit.named_modules():
            where = ".".join(part for part in (blocks_path, str(index), name) if part)
            facts = moe_block(where, module, config)
            if facts is not None:
                found.append(facts)
    return tuple(found)


def router_loss(config: Any, moe: tuple[ExpertFacts, ...]) -> RouterLoss | None:
    """The load-balancing loss the model's config defines, when it has MoE blocks and a coefficient."""
    coefficient = getattr(config, ROUTER_LOSS_COEFFICIENT, None)
    if not moe or not isinstance(coefficient, (int, float)) or isinstance(coefficient, bool):
        return None
    switch = ROUTER_LOSS_SWITCH if hasattr(config, ROUTER_LOSS_SWITCH) else None
    return RouterLoss(float(coefficient), switch, bool(getattr(config, switch)) if switch else True)
