"""Expert parallelism on a model: each MoE block's expert bank split over the `ep` ranks.

The bank's parameters become DTensors sharded on dim 0 (the experts) over the ep mesh, so a full state dict,
an export and a checkpoint that reshards see whole banks. Its forward becomes dispatch → the model's own expert
computation on this rank's experts → combine (`dispatch.py`): any bank that takes (hidden, top_k_index,
top_k_weights) — transformers 5's fused experts, Mixtral to DeepSeek-V3 and gpt-oss — runs without a kernel of
its own. The router, shared experts and everything else stay as the other layouts leave them. LoRA on the bank
(peft's `target_parameters`): the adapters stay whole on every rank, and each rank adds its own experts'
updates to its pieces (in place of peft's parametrization of the whole bank, which a piece cannot take).

Gradients: a bank's gradient on a rank sums the losses of every token its ep group routed to it, so it is
summed over the edp ranks (which hold the same experts) and divided by all dp × cp ranks — the same average
every other parameter gets (FSDP's divide factor, or `GradientAllReduce(divisor=)`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshkit.config.layout import choices_text
from meshkit.core.errors import MeshkitError
from meshkit.models.adapters import expert_delta, parameter_adapters
from meshkit.models.experts import moe_blocks
from meshkit.models.facts import ExpertFacts
from meshkit.parallel.expert.dispatch import exchange, routed_experts

EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts")  # what a bank's own forward reads its size from


class ExpertParallelError(MeshkitError):
    """An expert-parallel layout that cannot run; the message says what to change."""


def check_expert_parallel(moe: tuple[ExpertFacts, ...], ep: int, token_ranks: int, strategy: str) -> None:
    """Refuse, in one line, what expert parallelism cannot do; `token_ranks` = dp × cp."""
    if strategy in ("parameter_server", "dataparallel"):
        raise ExpertParallelError(f"parallel.ep={ep} needs the mesh strategy, not {strategy}: set parallel.ep=1")
    for facts in moe:
        if not facts.fused:
            raise ExpertParallelError(
                f"parallel.ep={ep}: the experts of {facts.path} are a list of modules; expert parallel splits a "
                "fused bank (one 3-D tensor per projection, experts first, as transformers 5 builds them)"
            )
        if facts.uneven:
            raise ExpertParallelError(
                f"parallel.ep={ep}: the expert bank of {facts.path} holds different expert counts in its tensors "
                "(rows for experts that compute nothing beside the real ones), which expert parallel cannot deal "
                "out evenly: set parallel.ep=1"
            )
        if facts.experts % ep:
            fits = [d for d in range(1, facts.experts + 1) if facts.experts % d == 0 and token_ranks % d == 0]
            where = f"the {facts.experts} experts of {facts.path}"
            raise ExpertParallelError(f"parallel.ep={ep} does not divide {where}: choose {choices_text(fits)}")


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, edp_mesh: DeviceMesh, capacity_factor: float | None = None
) -> list[nn.Module]:
    """Split every expert bank of `model` over `ep_mesh`; returns the banks (their gradients need edp reduction).
    `capacity_factor`: None routes every token (dropless), else see `dispatch.Route.plan`."""
    banks = []
    for facts in moe_blocks(model):
        bank, adapters = parameter_adapters(model.get_submodule(facts.path).get_submodule(facts.bank))
        _check_calling_convention(bank, f"{facts.path}.{facts.bank}")
        for wrapper in adapters.values():  # the adapters join the local pieces below, not by peft's parametrization
            wrapper.forward = _PassThrough(cast(nn.Module, wrapper.base_layer))
        for owner, name, param in expert_parameters(bank, facts.experts):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])  # rank 0 of each ep group deals its experts
            if edp_mesh.size() > 1 and not sharded.is_meta:  # replicas of the experts start equal, as DDP's do
                dist.broadcast(sharded.to_local(), group=edp_mesh.get_group(), group_src=0)
            owner.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        forward = ExpertParallelForward(bank, facts.experts, ep_mesh, capacity_factor, adapters)
        bank.forward = forward
        banks.append(bank)
    return banks


def expert_parameters(bank: nn.Module, experts: int) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(module, name, parameter) of every tensor the bank holds per expert: its own, and those of modules inside it
    whose first dim is the expert count (Ergo's per-expert norm scale, indexed by the expert ids the bank runs)."""
    found = []
    for module in bank.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if module is bank or (param.dim() > 0 and param.shape[0] == experts):
                found.append((module, name, param))
    return found


def _check_calling_convention(bank: nn.Module, path: str) -> None:
    """A bank expert parallel can drive takes the tokens alone (every expert's rows, Llama 4) or with their
    routing (`top_k_index`, `top_k_weights`: transformers 5's banks); another convention stops in one line."""
    try:
        names = list(inspect.signature(type(bank).forward).parameters)[1:]
    except (TypeError, ValueError):
        return
    if len(names) not in (1, 3):
        raise ExpertParallelError(
            f"parallel.ep: the expert bank {path} ({type(bank).__name__}) is called as forward({', '.join(names)}), "
            "not with the tokens and their routing that expert parallel sends between ranks: set parallel.ep=1"
        )


class _PassThrough:
    """A LoRA wrapper's forward under expert parallel: straight to the module it wraps."""

    def __init__(self, inner: nn.Module) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


class ExpertParallelForward:
    """The bank's forward under expert parallel: route, run the bank's own forward on this rank's experts, combine."""

    def __init__(
        self,
        bank: nn.Module,
        experts: int,
        ep_mesh: DeviceMesh,
        capacity_factor: float | None,
        adapters: dict[str, nn.Module] | None = None,
    ) -> None:
        self.bank = bank
        self.experts = experts
        self.capacity_factor = capacity_factor
        self.group = ep_mesh.get_group()
        self.local_experts = experts // ep_mesh.size()
        self.first_expert = ep_mesh.get_local_rank() * self.local_experts
        self.adapters = adapters or {}  # parameter name -> peft's LoRA wrapper of it (lora_target_parameters)
        self.own_forward = type(bank).forward  # the class's: the instance attribute is this object

    def __call__(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor | None = None, top_k_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if top_k_index is None or top_k_weights is None:  # every token for every expert, already weighted
            return self._every_token(hidden)
        return routed_experts(
            hidden, top_k_index, top_k_weights, self.experts, self.group, self._compute, self.capacity_factor
        )

    def _every_token(self, rows: torch.Tensor) -> torch.Tensor:
        """A bank that takes each expert's rows for every token, experts one after another and the routing
        weight already applied (Llama 4: [experts · tokens, hidden]): each rank's rows for an expert go to the
        rank holding it, which runs the bank's own forward on its experts' rows from every rank and sends the
        outputs back. (An unrouted token's row is zeros, its output zero: the model's sum is unchanged.)"""
        ep, local = dist.get_world_size(self.group), self.local_experts
        tokens = rows.shape[0] // self.experts
        counts = torch.tensor([tokens], device=rows.device)
        everyone = [torch.zeros_like(counts) for _ in range(ep)]
        dist.all_gather(everyone, counts, group=self.group)
        sources = [int(count) for count in everyone]  # tokens of each ep rank (uneven batches allowed)
        received = exchange(rows, [local * n for n in sources], [local * tokens] * ep, self.group)
        pieces = received.split([local * n for n in sources])
        parts = [part.view(local, n, -1) for part, n in zip(pieces, sources, strict=True)]
        by_expert = torch.cat(parts, dim=1).reshape(-1, rows.shape[-1])  # [local · Σ tokens, hidden]
        with self._local_experts() as anchor:
            out = self.own_forward(self.bank, by_expert) + anchor
        out = out.view(local, sum(sources), -1).split(sources, dim=1)  # back to each source rank, expert-major
        returned = torch.cat([part.reshape(local * n, -1) for part, n in zip(out, sources, strict=True)])
        return exchange(returned, [local * tokens] * ep, [local * n for n in sources], self.group)

    def _compute(self, tokens: torch.Tensor, local_expert: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        with self._local_experts() as anchor:
            out = self.own_forward(self.bank, tokens, local_expert, weights)
        # Every local expert and the tokens that arrived take part in the graph even when no token came (a loop
        # over the experts hit leaves them out): each rank then has a gradient for every expert parameter (zero
        # where no token came), so the edp reductions match, and each joins the all-to-all of backward.
        return out + anchor + tokens.reshape(-1)[:1].sum() * 0

    @contextlib.contextmanager
    def _local_experts(self) -> Iterator[torch.Tensor]:
        """The bank's parameters as this rank's plain pieces, and its expert count as theirs, for one call."""
        held = dict(self.bank._parameters)
        inner = {id(m): (m, dict(m._parameters)) for m in self.bank.modules() if m is not self.bank and m._parameters}
        counts = {name: getattr(self.bank, name) for name in EXPERT_COUNT_ATTRIBUTES if hasattr(self.bank, name)}
        try:
            anchor = None
            for module, params in inner.values():  # (per-expert tensors of modules inside the bank: their pieces)
                for name, param in params.items():
                    if isinstance(param, DTensor):
                        local = param.to_local()
                        module._parameters[name] = local
                        touch = local.reshape(-1)[:1].sum() * 0
                        anchor = touch if anchor is None else anchor + touch
            for name, param in held.items():
                if param is None:
                    continue
                local = param.to_local() if isinstance(param, DTensor) else param
                if name in self.adapters:  # W + this rank's experts' low-rank updates (their gradients: A's, B's)
                    shape, first, count = local.shape, self.first_expert, self.local_experts
                    delta = expert_delta(self.adapters[name], self.experts, first, count, shape)
                    local = local if delta is None else local + delta.to(local.dtype)
                self.bank._parameters[name] = local  # type: ignore[assignment]  # a plain tensor in a parameter's slot, for this forward
                touch = local.reshape(-1)[:1].sum() * 0
                anchor = touch if anchor is None else anchor + touch
            for name in counts:
                setattr(self.bank, name, self.local_experts)
            yield anchor if anchor is not None else torch.zeros(())
        finally:
            self.bank._parameters.update(held)
            for module, params in inner.values():
                module._parameters.update(params)
            for name, value in counts.items():
                setattr(self.bank, name, value)
