"""LoRA-adapted transformers models (adapters already away from their start, so that every adapter weight gets a
gradient from the first step) trained in a gloo world, and the same in one plain-torch process."""

from __future__ import annotations

import functools

import torch

from tests.helpers.distributed import leave_world
from tests.helpers.hf_layouts import batches, one_process, train_in_layout
from tests.helpers.hf_models import causal_lm

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def adapted(family: str) -> torch.nn.Module:
    import peft

    model = causal_lm(family)
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    for name, param in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return wrapped.get_base_model()


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


@functools.cache
def lora_reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = adapted(family)
    return one_process(model, _optimizer(model), batches())


def train_adapted(rank: int, family: str, layouts: dict[str, dict]) -> dict[str, dict]:
    torch.distributed.init_process_group("gloo")
    out = {label: train_in_layout(family, overrides, adapted, _optimizer) for label, overrides in layouts.items()}
    leave_world()
    return out
