"""The estimator and planner under expert parallelism: expert states split over ep (tensor parallel keeps expert
banks whole), ZeRO-3 shards a rank's experts over the dp·cp/ep ranks holding the same ones, the all-to-all
volume per step, and ep proposed where it pays (a model whose experts ZeRO-3 would gather over slow links)."""

from __future__ import annotations

import pytest

from meshkit.config.layout import Layout
from meshkit.planning.estimate import EstimateError, estimate_memory, moe_shape
from meshkit.planning.hardware import preset
from meshkit.planning.perf_model import Topology, all_to_all_bytes, predict
from meshkit.planning.plan import Cluster, plan, to_config

# a Qwen3-30B-A3B-like config, and a DeepSeek-V3-like one
QWEN3_30B = dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                 vocab_size=151936, head_dim=128)  # fmt: skip
DEEPSEEK_V3 = dict(num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                   n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=18432,
                   vocab_size=129280, n_shared_experts=1, first_k_dense_replace=3)  # fmt: skip


def test_expert_states_split_over_ep_and_stay_whole_under_tp() -> None:
    shape = moe_shape(QWEN3_30B)
    dense = shape.params - shape.expert_params
    plain = estimate_memory(shape, precision="fp32", optimizer="sgd", dp=8, tp=2)
    assert plain.gb("params") * 1e9 == pytest.approx(4 * (dense / 2 + shape.expert_params))
    split = estimate_memory(shape, precision="fp32", optimizer="sgd", dp=8, ep=8)
    split4 = estimate_memory(shape, precision="fp32", optimizer="sgd", dp=8, ep=4)
    assert split.gb("params") * 1e9 == pytest.approx(4 * (dense + shape.expert_params / 8))
    sharded = estimate_memory(shape, precision="fp32", optimizer="sgd", dp=8, ep=4, zero_stage=3)
    # ZeRO-3: dense over all 8 ranks; each rank's quarter of the experts over the 2 ranks that hold it
    assert sharded.gb("params") * 1e9 == pytest.approx(4 * (dense / 8 + shape.expert_params / 4 / 2))
    assert "Ψexperts/(ep·pp)" in split.lines[0].formula
    chunked = estimate_memory(shape, precision="fp32", optimizer="sgd", dp=8, ep=4, zero_stage=1)
    # ZeRO-1: whole parameters; the optimizer's chunks as ZeRO-3's parameter shards
    assert chunked.gb("params") == pytest.approx(split4.gb("params"))
    assert chunked.gb("optimizer") * 1e9 == pytest.approx(4 * (dense / 8 + shape.expert_params / 4 / 2))
    with pytest.raises(EstimateError, match="ep=3 must divide dp·cp=6 and the 128 experts"):
        estimate_memory(shape, dp=6, ep=3)


def test_the_all_to_all_volume_follows_the_routed_copies() -> None:
    shape = moe_shape(QWEN3_30B)
    layout = Layout(dp_replicate=8, ep=4)
    sent = all_to_all_bytes(shape, layout, seq_len=4096, micro_batch=1, act_b=2)
    # dispatch and combine, forward and backward, of top-k copies of every token; 3/4 of them leave the rank
    assert sent == 4 * 8 * 4096 * 2048 * 2 * 3 / 4
    assert all_to_all_bytes(shape, Layout(dp_replicate=8), seq_len=4096, micro_batch=1, act_b=2) == 0


def test_the_planner_proposes_ep_where_it_pays() -> None:
    big = plan(moe_shape(DEEPSEEK_V3), Cluster(8, 80, 32, inter_node="ib"), seq_len=4096, global_batch=1024)
    fastest = big.fitting[0]
    assert fastest.layout.ep > 1 and "EP=" in fastest.reason
    assert fastest.time is not None and fastest.time.comm_s["ep_all_to_all"] > 0
    assert to_config(fastest.layout, Cluster(8, 80, 32), 4096, 1024, "bf16")["parallel"]["ep"] == fastest.layout.ep
    # one node: ZeRO-3's expert gathers hide behind compute, and the all-to-all would not
    small = plan(moe_shape(QWEN3_30B), Cluster(8, 80, 1), seq_len=4096, global_batch=64)
    assert small.fitting[0].layout.ep == 1 and any(lay.layout.ep > 1 for lay in small.fitting)


def test_the_balancing_loss_under_pp_costs_one_forward_more() -> None:
    """Under pp the router's balancing loss counts the routing in a forward-only pass first: a third of the
    step's compute more, with its bubble; without pp, nothing."""
    plain, counted = moe_shape(QWEN3_30B), moe_shape({**QWEN3_30B, "output_router_logits": True,
                                                       "router_aux_loss_coef": 0.001})  # fmt: skip
    assert counted.router_loss and not plain.router_loss
    topology, hardware = Topology(8, 1), preset("h100")
    times = {}
    for name, shape in (("plain", plain), ("counted", counted)):
        for pp in (1, 2):
            layout = Layout(dp_replicate=8 // pp, pp=pp, zero_stage=3 if pp == 1 else 1)
            times[name, pp] = predict(shape, layout, topology, hardware, seq_len=4096, global_batch=64)
    assert times["counted", 1].step_s == times["plain", 1].step_s
    extra = times["counted", 2].recompute_s - times["plain", 2].recompute_s
    assert extra == pytest.approx(times["plain", 2].compute_s / 3)
    assert times["counted", 2].bubble_s > times["plain", 2].bubble_s
