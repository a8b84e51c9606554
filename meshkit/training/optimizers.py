"""The fine-tune's optimizer by its Axolotl / transformers name: torch's AdamW and SGD, transformers' Adafactor,
bitsandbytes' 8-bit optimizers, whose two Adam states take 1 byte per parameter each instead of 4 (blockwise
quantised; tensors under 4096 elements keep 32-bit states, as bitsandbytes decides), and torchao's low-bit AdamW
(`adamw_torch_8bit`, `adamw_torch_4bit`: ½ byte per state; `ao_adamw_fp8`), whose update is plain torch (compiled
by torchao with torch.compile) and so runs on a CPU as on a GPU; `muon` (`meshkit.training.muon`: Muon for the
hidden matrices, AdamW for the rest).

Paged optimizers page their states to host memory through CUDA unified memory; on a CPU there is nothing to page,
so they run as their unpaged twin (one notice line). bitsandbytes' kernels take plain tensors: they run under DDP,
pipeline stages, ZeRO-1/2 (a rank's flat chunk) and on the local pieces of ZeRO-3's and tensor parallel's DTensors
(`meshkit.parallel.zero.local_shards`); torchao's are stepped the same way. Checkpoints hold their states
dequantized (`meshkit.checkpoint.optimizer_states`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from meshkit.config.section import Section
from meshkit.core.errors import MeshkitError
from meshkit.training.muon import MuonWithAdamW


class LrGroup(Section):
    """One entry of Axolotl's `lr_groups`."""

    name: str = Field(description="the group's name")
    modules: tuple[str, ...] = Field(description="parameter-name parts: matrices whose names hold one join the group")
    lr: float = Field(gt=0, description="the group's learning rate")


class OptimizerError(MeshkitError):
    """An optimizer that cannot run here; the message says what to install or choose."""


@dataclass(frozen=True)
class OptimizerKind:
    family: str  # adamw | sgd | adafactor | bnb | torchao | muon
    bnb_class: str | None = None  # bitsandbytes.optim (or torchao.optim) class
    unpaged: str | None = None  # the class a CPU runs instead of a paged one
    state_bytes: int = 8  # optimizer state bytes per parameter (estimator)


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw_torch": OptimizerKind("adamw"),
    "adamw_torch_fused": OptimizerKind("adamw"),
    "adamw_hf": OptimizerKind("adamw"),
    "adamw": OptimizerKind("adamw"),
    "sgd": OptimizerKind("sgd", state_bytes=0),
    "adafactor": OptimizerKind("adafactor", state_bytes=4),
    "adamw_bnb_8bit": OptimizerKind("bnb", "AdamW8bit", state_bytes=2),
    "adamw_8bit": OptimizerKind("bnb", "AdamW8bit", state_bytes=2),
    "paged_adamw_8bit": OptimizerKind("bnb", "PagedAdamW8bit", "AdamW8bit", state_bytes=2),
    "paged_adamw_32bit": OptimizerKind("bnb", "PagedAdamW32bit", "AdamW32bit"),
    "lion_8bit": OptimizerKind("bnb", "Lion8bit", state_bytes=1),
    "paged_lion_8bit": OptimizerKind("bnb", "PagedLion8bit", "Lion8bit", state_bytes=1),
    "adamw_torch_8bit": OptimizerKind("torchao", "AdamW8bit", state_bytes=2),
    "ao_adamw_8bit": OptimizerKind("torchao", "AdamW8bit", state_bytes=2),
    "adamw_torch_4bit": OptimizerKind("torchao", "AdamW4bit", state_bytes=1),
    "ao_adamw_4bit": OptimizerKind("torchao", "AdamW4bit", state_bytes=1),
    "ao_adamw_fp8": OptimizerKind("torchao", "AdamWFp8", state_bytes=2),
    "muon": OptimizerKind("muon", state_bytes=4),  # one momentum buffer for the matrices (most parameters)
}
PLAIN_TENSOR_FAMILIES = ("bnb", "torchao")  # stepped on plain tensors: a rank's local pieces of DTensors


def build_optimizer(
    name: str, groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float, extra: dict[str, Any]
) -> tuple[torch.optim.Optimizer, list[str]]:
    """The optimizer `name` over `groups`, and the notices it gives (a paged optimizer on a CPU)."""
    kind = OPTIMIZERS[name]
    notes: list[str] = []
    if kind.family == "sgd":
        return torch.optim.SGD(groups, lr=lr, **extra), notes
    if kind.family == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **extra), notes
    if kind.family == "adafactor":
        from transformers.optimization import Adafactor

        options = {"scale_parameter": False, "relative_step": False, "warmup_init": False, **extra}
        return Adafactor(groups, lr=lr, **options), notes
    if kind.family == "muon":
        return MuonWithAdamW(groups, lr=lr, betas=betas, eps=eps, **extra), notes
    if kind.family == "torchao":
        return _torchao(name, str(kind.bnb_class))(groups, lr=lr, betas=betas, eps=eps, **extra), notes
    try:
        import bitsandbytes.optim as bnb_optim
    except ImportError:
        raise OptimizerError(
            f"optimizer: {name} needs bitsandbytes: pip install 'meshkit[hf]' (or choose adamw_torch)"
        ) from None
    class_name = kind.bnb_class
    params = [p for group in groups for p in group["params"]]
    on_cpu = all(p.device.type == "cpu" for p in params)
    if kind.unpaged and on_cpu:
        class_name = kind.unpaged
        notes.append(f"optimizer: {name} pages states through CUDA memory; on a CPU it runs as {class_name}")
    optimizer_class = getattr(bnb_optim, str(class_name))
    options = {"lr": lr, **({"betas": betas} if "Lion" in str(class_name) else {"betas": betas, "eps": eps}), **extra}
    return optimizer_class(groups, **options), notes


def _torchao(name: str, class_name: str) -> Any:
    try:
        import torchao.optim as ao_optim
    except ImportError:
        raise OptimizerError(
            f"optimizer: {name} needs torchao: pip install 'meshkit[hf]' (or choose adamw_torch)"
        ) from None
    return getattr(ao_optim, class_name)


def check_layout(name: str, zero_stage: int, tp: int) -> None:
    """bitsandbytes' and torchao's low-bit optimizers step plain tensors: whole parameters (DDP, pipeline stages),
    ZeRO-1/2's flat chunks, or the local pieces of ZeRO-3's and tp's DTensors
    (`meshkit.parallel.zero.local_shards`); ZeRO-1/2's flat chunks of tp shards are refused in one line."""
    family = OPTIMIZERS[name].family
    if family == "muon" and zero_stage in (1, 2):
        raise OptimizerError(
            f"optimizer: muon orthogonalises whole weight matrices, but zero_stage {zero_stage} steps flat chunks of "
            "many parameters: use zero_stage 3 (FSDP; each rank gathers one matrix at a time) or 0"
        )
    if family in PLAIN_TENSOR_FAMILIES and zero_stage in (1, 2) and tp > 1:
        library = "bitsandbytes" if family == "bnb" else "torchao"
        raise OptimizerError(
            f"optimizer: {name} ({library}) with zero_stage {zero_stage} and tp={tp} is not supported: use "
            "zero_stage 3 or 0 with tp (each rank steps its local shards), or adamw_torch"
        )


def trainable_groups(parameters: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in two groups: matrices with weight decay, biases and norm weights without."""
    trainable = [p for p in parameters if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def axolotl_groups(
    named: list[tuple[str, torch.nn.Parameter]],
    embeddings: set[int],
    *,
    lr: float,
    weight_decay: float,
    embedding_lr: float | None = None,
    embedding_lr_scale: float | None = None,
    lr_groups: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Axolotl's param groups when it sets learning rates per group: matrices with weight decay; the embedding
    and head (`embeddings`: ids of their parameters) without decay at `embedding_lr_scale` × lr or `embedding_lr`;
    biases and norm weights without decay; and each of `lr_groups` ({name, modules, lr}) for the decayed matrices
    whose names hold one of its `modules` strings."""
    decayed: list[torch.nn.Parameter] = []
    embedded: list[torch.nn.Parameter] = []
    plain: list[torch.nn.Parameter] = []
    grouped: dict[str, list[torch.nn.Parameter]] = {group["name"]: [] for group in lr_groups or []}
    for name, param in named:
        if not param.requires_grad:
            continue
        if id(param) in embeddings:
            embedded.append(param)
        elif param.ndim >= 2:
            owner = next((g["name"] for g in lr_groups or [] if any(module in name for module in g["modules"])), None)
            (grouped[owner] if owner is not None else decayed).append(param)
        else:
            plain.append(param)
    embedding_rate = lr * embedding_lr_scale if embedding_lr_scale else embedding_lr or lr
    out = [
        {"params": decayed, "weight_decay": weight_decay, "lr": lr},
        {"params": embedded, "weight_decay": 0.0, "lr": embedding_rate},
        {"params": plain, "weight_decay": 0.0, "lr": lr},
        *({"params": grouped[g["name"]], "weight_decay": weight_decay, "lr": g["lr"]} for g in lr_groups or []),
    ]
    return [group for group in out if group["params"]]
