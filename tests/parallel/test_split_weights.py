"""How tensor parallel stores fused weights (q/k/v, gate/up): one owner, `SplitWeights`, to and from the canonical
order — a round trip is exact, each rank's contiguous slice holds its share of every part, and the engine's full
state dict and `load_full_state_dict` speak the canonical order under tp 2."""

from __future__ import annotations

import torch

from meshkit.engine import Engine
from meshkit.models.gpt import lm_loss
from meshkit.parallel.tensor.storage import FusedParts, SplitWeights
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.layouts import build
from tests.helpers.training import make_optimizer


def test_the_storage_order_gives_each_rank_its_share_of_every_part_and_comes_back_exactly() -> None:
    q, k, v = torch.arange(8.0), 100 + torch.arange(4.0), 200 + torch.arange(4.0)  # GQA: k and v narrower
    split = SplitWeights(2, {"attn.qkv.weight": FusedParts(0, (8, 4, 4))})
    canonical = torch.cat([q, k, v])
    stored = split.to_storage("attn.qkv.weight", canonical)
    rank0, rank1 = stored.chunk(2)
    assert torch.equal(rank0, torch.cat([q[:4], k[:2], v[:2]]))
    assert torch.equal(rank1, torch.cat([q[4:], k[2:], v[2:]]))
    assert torch.equal(split.to_canonical("attn.qkv.weight", stored), canonical)
    other = torch.randn(3)
    assert split.to_storage("mlp.weight", other) is other and split.to_canonical("mlp.weight", other) is other


def test_layouts_are_named_under_a_prefix_and_joined() -> None:
    first = SplitWeights(2, {"a.weight": FusedParts(1, (2, 2))})
    second = SplitWeights(2, {"b.weight": FusedParts(0, (3, 3, 3))})
    joined = SplitWeights.union([first.prefixed("model.0"), second.prefixed("model.0")], 2)
    assert joined.names == {"model.0.a.weight", "model.0.b.weight"} and "model.0.a.weight" in joined
    assert not SplitWeights(2) and joined


def _fused_round_trip(rank: int) -> dict:
    torch.distributed.init_process_group("gloo")
    engine = Engine(seed=0, tp=2)
    model = build("gpt2")
    model, _ = engine.prepare(model, make_optimizer(model), loss_fn=lm_loss)
    before = engine.full_state_dict()
    fused = sorted(name for name in before if "c_attn" in name)
    changed = {name: torch.arange(before[name].numel(), dtype=before[name].dtype).view_as(before[name])
               for name in fused}  # fmt: skip
    left_out = engine.load_full_state_dict(changed)
    after = engine.full_state_dict()
    engine.end()
    leave_world()
    return {"fused": fused, "left_out": left_out, "changed": changed, "after": {n: after[n] for n in fused}}


def test_fused_weights_go_in_and_out_of_a_tensor_parallel_model_in_the_canonical_order() -> None:
    for result in run_world(_fused_round_trip, 2, timeout=180):
        assert result["fused"] and result["left_out"] == []
        for name in result["fused"]:
            assert torch.equal(result["after"][name], result["changed"][name]), name
