"""ZeRO-3 (FSDP) and HSDP with torch's FSDP2 `fully_shard`: parameters, gradients and optimizer states sharded.

Consecutive repeated blocks form FSDP units of about `sharding.unit_mb` of parameters (a unit's parameters are
all-gathered in one collective just before its forward and freed after it; its gradients are reduce-scattered
in one), then the root takes the remaining parameters (embedding, final norm, head). A model without a list of
repeated blocks is sharded by its children that hold parameters (one notice line). On a 2-D mesh
(dp_replicate, dp_shard) the same call is HSDP: sharded within a replica group, replicated across groups.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from meshkit.config.schema import ShardingConfig
from meshkit.models.blocks import BlockError, block_units, find_blocks
from meshkit.runtime.dtensors import local_tensor
from meshkit.runtime.mesh import ParallelMesh
from meshkit.runtime.ring_collectives import RingAllGather, RingReduceScatter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class OffloadNotice(UserWarning):
    """CPU offload asked for on a host where parameters already live in CPU memory."""


class UnitsNotice(UserWarning):
    """A model without a list of repeated blocks is sharded by its children."""


def shard_units(model: nn.Module, blocks: str | None) -> list[nn.Module]:
    """The modules FSDP shards one at a time: the repeated blocks; for a model without a list of them, its
    children that hold parameters (the root takes the rest), said in one notice line."""
    try:
        _, block_list = find_blocks(model, blocks)
    except BlockError:
        if blocks is not None:
            raise
    else:
        return [block for _, block in block_units(block_list)]
    children = [(name, child) for name, child in model.named_children() if next(child.parameters(), None) is not None]
    more = f" and {len(children) - 4} more" if len(children) > 4 else ""
    names = ", ".join(name for name, _ in children[:4]) + more
    what = f"its children ({names}) as units, the root the rest" if children else "the whole model as one unit"
    warnings.warn(
        f"zero_stage=3: {type(model).__name__} has no list of repeated blocks, so FSDP shards {what}; name a block "
        "list with blocks='path.to.layers' for finer units",
        UnitsNotice,
        stacklevel=3,
    )
    return [child for _, child in children]


def fsdp_mesh(mesh: ParallelMesh) -> DeviceMesh:
    """(dp_replicate, dp_shard × cp) for HSDP, dp_shard × cp alone otherwise (cp ranks share the shards)."""
    return mesh.fsdp_mesh


def mixed_precision_policy(cfg: ShardingConfig, precision: str) -> MixedPrecisionPolicy:
    """Gathered parameters in the run's precision (or `param_dtype`); gradients reduced in fp32 by default."""
    param = cfg.param_dtype or {"bf16": "bf16", "fp16": "fp16"}.get(precision, "fp32")
    return MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[cfg.reduce_dtype or "fp32"])


def offload_policy(cfg: ShardingConfig, device: torch.device) -> CPUOffloadPolicy | None:
    if cfg.offload != "cpu":
        return None
    if device.type == "cpu":
        warnings.warn(
            "offload=cpu: on this CPU-only host parameters, gradients and optimizer states already live in CPU "
            "memory, so there is nothing to move; the run continues as plain zero_stage=3",
            OffloadNotice,
            stacklevel=3,
        )
        return None
    return CPUOffloadPolicy(pin_memory=True)


def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh,
    cfg: ShardingConfig,
    precision: str,
    blocks: str | None = None,
    experts: tuple[nn.Module, ...] | list[nn.Module] = (),
) -> nn.Module:
    """Shard each expert bank (split over ep: over the edp ranks that hold the same experts), each unit of
    blocks (`group_blocks`), then the root. Returns the same module object (FSDP2 works in place)."""
    units = group_blocks(shard_units(model, blocks), cfg.unit_mb)
    options: dict[str, Any] = {"mesh": fsdp_mesh(mesh), "mp_policy": mixed_precision_policy(cfg, precision)}
    policy = offload_policy(cfg, mesh.device)
    if policy is not None:
        options["offload_policy"] = policy
    for bank in experts:
        sharded_bank = fully_shard(bank, **{**options, "mesh": mesh.expert_dim("edp")})
        # the bank's gradient sums its ep group's tokens: dividing by every dp × cp rank gives the average
        sharded_bank.set_gradient_divide_factor(float(mesh.grad_size))
        # a sum, then the division (gloo has no pre-scaled sum); on one edp rank FSDP divides in its copy, and
        # forcing the sum there would divide twice
        sharded_bank.set_force_sum_reduction_for_comms(mesh.expert_dim("edp").size() > 1)
    sharded_units: list[FSDPModule] = []
    for index, unit in enumerate(units):
        # The last unit runs first in backward: freeing its parameters after forward would only make
        # backward gather them again at once.
        reshard = cfg.reshard_after_forward if cfg.reshard_after_forward is not None else index < len(units) - 1
        sharded = fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=reshard, **options)
        sharded_units.append(sharded[0] if isinstance(sharded, list) else sharded)  # one module stands for its unit
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward is not False, **options)
    set_prefetch(sharded_units, cfg.forward_prefetch, cfg.backward_prefetch)
    if cfg.ring_collectives and mesh.device.type == "cpu":
        use_ring_collectives(model)
    return model


def use_ring_collectives(model: nn.Module) -> None:
    """Every FSDP module of `model` gathers and reduce-scatters in rings of sends (`ring_collectives`): on the
    host, gloo's own collectives copy every part and reduce by all-reduce. Needs torch >= 2.8 (FSDP2's
    pluggable collectives); older torch keeps the backend's."""
    for module in model.modules():
        if isinstance(module, FSDPModule) and hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(RingAllGather())
            module.set_custom_reduce_scatter(RingReduceScatter())


def group_blocks(blocks: list[nn.Module], unit_mb: float) -> list[list[nn.Module]]:
    """Consecutive blocks in units of at most `unit_mb` of parameters (a block bigger than that is a unit of its
    own; 0 = one block per unit). Fewer, larger collectives: each costs a fixed latency (every rank must reach
    it) besides its bytes, as DeepSpeed's ZeRO-3 buckets its gathers and reductions by size."""
    limit = unit_mb * 1e6
    units: list[list[nn.Module]] = []
    held = 0.0
    for block in blocks:
        size = float(sum(local_bytes(p) for p in block.parameters()))
        if units and held + size <= limit:
            units[-1].append(block)
            held += size
        else:
            units.append([block])
            held = size
    return units


def local_bytes(parameter: torch.Tensor) -> int:
    """Bytes of the part of a parameter this rank holds before FSDP (a tensor-parallel DTensor: its local part)."""
    local = local_tensor(parameter)
    return local.numel() * local.element_size()


def set_prefetch(units: list[FSDPModule], forward: int, backward: int) -> None:
    """Issue the all-gathers of the next `forward` units (forward) and the previous `backward` units (backward)
    as soon as a unit starts, so they run while it computes. 0 keeps torch's defaults (forward: the next
    all-gather overlaps through its own stream on GPUs; backward: one unit ahead). More hides more latency and
    holds more gathered units at once."""
    for index, unit in enumerate(units):
        if forward:
            unit.set_modules_to_forward_prefetch(list(units[index + 1 : index + 1 + forward]))
        if backward:
            unit.set_modules_to_backward_prefetch(list(units[max(0, index - backward) : index][::-1]))


def reshard(model: nn.Module) -> None:
    """Free the parameters a forward without backward (evaluation) left gathered: FSDP reshards the root and
    the last block only after backward, and until then the model would show full, unsharded parameters."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
