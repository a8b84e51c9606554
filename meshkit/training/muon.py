"""`optimizer: muon`: Muon (momentum, then the update orthogonalised by Newton–Schulz iterations) for the hidden
weight matrices, AdamW for everything else (embeddings, the output head, biases, norms, tensors that are not
matrices), as Muon's authors and Axolotl split them — one optimizer, one state dict, one set of param groups for
the schedule.

The orthogonalisation is torch's own (`torch.optim.Muon`'s, torch ≥ 2.9) and needs the whole matrix: a parameter
sharded by ZeRO-3 or tensor parallel (a DTensor) has its update gathered, orthogonalised on every rank and sliced
back to the rank's piece — one matrix at a time, so the extra memory is one matrix — so every layout orthogonalises
the matrix one process would (Newton–Schulz runs in bfloat16, as torch defines it: the last bits of a gradient
summed over ranks in another order show as ~1e-4 relative in the loss). ZeRO-1/2 step flat chunks of many
parameters, where no matrix is left to orthogonalise: `check_layout` refuses them in one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

MUON_DEFAULTS: dict[str, Any] = {
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "ns_coefficients": None,  # torch's
    "adjust_lr_fn": None,  # torch's ("original": lr × √max(1, rows/cols))
}


def split_for_muon(groups: list[dict[str, Any]], embeddings: set[int]) -> list[dict[str, Any]]:
    """Each param group split in two: its matrices that are neither the embedding nor the head (`embeddings`: ids
    of their parameters) with `use_muon`, and the rest without."""
    out: list[dict[str, Any]] = []
    for group in groups:
        for use_muon in (True, False):
            params = [p for p in group["params"] if _is_hidden_matrix(p, embeddings) == use_muon]
            if params:
                out.append({**group, "params": params, "use_muon": use_muon})
    return out


def _is_hidden_matrix(param: torch.Tensor, embeddings: set[int]) -> bool:
    return param.ndim == 2 and id(param) not in embeddings


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the groups marked `use_muon`, torch's AdamW over the others. The AdamW half is a
    `torch.optim.AdamW` sharing this optimizer's group dicts and state, so schedules, checkpoints and
    `load_state_dict` see one optimizer."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        **muon_options: Any,
    ) -> None:
        unknown = set(muon_options) - set(MUON_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown Muon options {sorted(unknown)}: choose from {sorted(MUON_DEFAULTS)}")
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(f"optimizer: muon needs torch >= 2.9 (this is {torch.__version__})")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "use_muon": False}
        super().__init__(list(params), {**defaults, **MUON_DEFAULTS, **muon_options})
        self._bind()

    def _bind(self) -> None:
        adam_groups = [group for group in self.param_groups if not group["use_muon"]]
        self._adam = torch.optim.AdamW(adam_groups) if adam_groups else None
        if self._adam is not None:
            self._adam.state = self.state  # one state for both halves

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._bind()  # the base class replaced the group dicts and the state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                for param in group["params"]:
                    if param.grad is not None:
                        self._muon_update(param, group)
        if self._adam is not None:
            self._adam.step()
        return loss

    def _muon_update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

        grad = param.grad
        assert grad is not None
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buffer = state["momentum_buffer"]
        momentum = group["momentum"]
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        whole = update.full_tensor() if isinstance(update, DTensor) else update
        coefficients = group["ns_coefficients"] or (DEFAULT_A, DEFAULT_B, DEFAULT_C)
        orthogonal = _zeropower_via_newtonschulz(whole, tuple(coefficients), group["ns_steps"], EPS)
        if isinstance(param, DTensor):
            orthogonal = distribute_tensor(orthogonal, param.device_mesh, param.placements, src_data_rank=None)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(orthogonal.to(param.dtype), alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], param.shape))
