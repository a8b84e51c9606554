"""Tiled MLP (`tiled_mlp`): each block's MLP over slices of the sequence under checkpointing — the same outputs and
gradients as the MLP whole, its intermediate activations never kept, in every layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from meshkit import Engine
from meshkit.models.structure import describe
from meshkit.models.token_wise import token_wise_mlps
from meshkit.parallel.tiled_mlp import tile_mlp
from tests.helpers.distributed import gloo_world, run_world

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
from tests.helpers.hf_layouts import batches, build, make_optimizer, rank_part  # noqa: E402
from tests.helpers.hf_models import causal_lm  # noqa: E402
from tests.helpers.moe_models import moe_causal_lm  # noqa: E402


def _saved_bytes(run: Any) -> int:
    """Bytes the forward of `run()` keeps for backward."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return total, out  # type: ignore[return-value]


def test_a_tiled_mlp_computes_the_same_outputs_and_gradients_and_keeps_only_its_input() -> None:
    model = causal_lm("llama")
    mlp = model.model.layers[0].mlp
    hidden = torch.randn(2, 64, mlp.hidden_size, requires_grad=True)
    whole_saved, whole = _saved_bytes(lambda: mlp(hidden))
    whole.square().sum().backward()
    want = [hidden.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    hidden.grad = None
    mlp.zero_grad()
    tile_mlp(mlp, shards=4)
    tiled_saved, tiled = _saved_bytes(lambda: mlp(hidden))
    tiled.square().sum().backward()
    got = [hidden.grad, *(p.grad for p in mlp.parameters())]
    assert torch.allclose(tiled, whole, rtol=1e-6, atol=1e-7)
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-6
    assert tiled_saved == hidden.numel() * 4  # (each slice's input: the intermediates are recomputed)
    assert whole_saved > 3 * tiled_saved  # (gate, up and their product, each wider than the hidden size)


class _MixingMLP(nn.Module):
    """An 'MLP' that mixes positions (a running mean): it cannot be tiled."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.up(hidden).cumsum(dim=1)


def test_the_mlps_that_compute_each_token_alone_are_learnt_mixing_and_expert_blocks_are_not() -> None:
    model = causal_lm("llama")
    layers = len(model.model.layers)
    assert token_wise_mlps(model, describe(model)) == tuple(f"model.layers.{i}.mlp" for i in range(layers))
    model.model.layers[1].mlp = _MixingMLP(model.config.hidden_size)
    assert "model.layers.1.mlp" not in token_wise_mlps(model, describe(model))
    mixtral = moe_causal_lm("mixtral")
    assert not [name for name in token_wise_mlps(mixtral, describe(mixtral)) if "mlp" in name]


LAYOUTS = {"ddp2": {}, "tp2_sp": {"tp": 2, "sequence_parallel": True}, "cp2": {"cp": 2},
           "zero3_2": {"zero_stage": 3}, "pp2": {"pp": 2, "schedule": "1f1b"},
           "ddp2_recompute": {"activation_checkpointing": {"mode": "full"}}}  # fmt: skip


def _train(tiled: bool, **settings: Any) -> dict[str, Any]:
    engine = Engine(seed=0, tiled_mlp=tiled, tiled_mlp_shards=4, **settings)
    try:
        model = build("llama")
        model, _ = engine.prepare(model, make_optimizer(model))
        losses = [engine.train_step(rank_part(engine, batch)).item() for batch in batches()]
        return {"losses": losses, "state": engine.full_state_dict()}
    finally:
        engine.end()


def _every_layout(rank: int) -> dict[str, Any]:
    with gloo_world():
        return {
            name: {tiled: _train(tiled, **settings) for tiled in (True, False)} for name, settings in LAYOUTS.items()
        }


@pytest.mark.world
def test_every_layout_trains_alike_with_tiled_mlps() -> None:
    for result in run_world(_every_layout, 2, timeout=300):
        for name in LAYOUTS:
            on, off = result[name][True], result[name][False]
            assert on["losses"] == pytest.approx(off["losses"], rel=1e-6), name
            for key, tensor in off["state"].items():
                scale = float(tensor.abs().max()) or 1.0
                assert float((on["state"][key] - tensor).abs().max()) / scale < 1e-6, (name, key)
