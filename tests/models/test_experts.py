"""The structure layer describes mixture-of-experts blocks — router, expert bank (fused 3-D or a list), shared
experts, top-k, the load-balancing loss — for transformers families and a user's own model alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshkit.models.structure import describe
from tests.helpers.hf_models import causal_lm
from tests.helpers.moe_models import EXPECTED, EXPERTS, MOE_FAMILIES, MORE_MOE_FAMILIES, TOP_K, moe_causal_lm


@pytest.mark.parametrize("family", MOE_FAMILIES + MORE_MOE_FAMILIES)
def test_moe_blocks_of_transformers_families_are_described(family: str) -> None:
    model = moe_causal_lm(family)
    found = describe(model)
    blocks, shared, coefficient = EXPECTED[family]
    assert len(found.moe) == blocks
    for facts in found.moe:
        assert (facts.experts, facts.top_k, facts.fused, facts.shared) == (EXPERTS, TOP_K, True, shared)
        block = model.get_submodule(facts.path)
        rows = [param.shape[0] for param in block.get_submodule(facts.router).parameters() if param.dim() == 2]
        assert EXPERTS in rows  # its own weight, or a Linear's inside it (HunYuan's gate.wg)
        assert facts.path.startswith(f"{found.blocks}.")
        assert facts.path.endswith((".mlp", ".block_sparse_moe", ".feed_forward"))
    names = dict(model.named_parameters())
    expert_names = found.expert_parameters
    assert expert_names and all(names[name].dim() == 3 and names[name].shape[0] == EXPERTS for name in expert_names)
    # every 3-D parameter of the model with a row per expert is a routed expert's (Qwen3-Next's convolution
    # weights are 3-D too): nothing an expert strategy must place is missed
    banks = {name for name, param in names.items() if param.dim() == 3 and param.shape[0] == EXPERTS}
    assert set(expert_names) == banks
    if coefficient is None:
        assert found.router_loss is None
    else:
        assert found.router_loss is not None and found.router_loss.coefficient == pytest.approx(coefficient)
        assert found.router_loss.switch == "output_router_logits"


def test_a_dense_model_has_no_moe_blocks() -> None:
    found = describe(causal_lm("llama"))
    assert found.moe == () and found.router_loss is None and found.expert_parameters == ()


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MoE(nn.Module):
    top_k = 1

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 3, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        return torch.stack([self.experts[int(c)](row) for c, row in zip(choice, x, strict=True)])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix, self.mlp = nn.Linear(8, 8), MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.mix(x))


def test_a_users_own_moe_with_a_list_of_experts_is_described() -> None:
    model = nn.Sequential(*(Block() for _ in range(2)))  # fewer blocks than experts: the blocks are still found
    assert len(model(torch.randn(5, 8))) == 5
    found = describe(model)
    assert found.blocks == "" and [facts.path for facts in found.moe] == ["0.mlp", "1.mlp"]
    facts = found.moe[0]
    assert (facts.router, facts.bank, facts.experts, facts.top_k, facts.fused) == ("router", "experts", 3, 1, False)
    assert facts.bank_parameters[:2] == ("experts.0.up.weight", "experts.0.up.bias") and facts.shared is None


class Classifier(nn.Module):
    """Four blocks and a head with one row per block: a dense model, not a mixture of experts."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 4)


def test_a_list_of_blocks_beside_a_head_with_as_many_rows_is_not_an_expert_bank() -> None:
    found = describe(Classifier())
    assert found.blocks == "layers" and found.moe == ()
