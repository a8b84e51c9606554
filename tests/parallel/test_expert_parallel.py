"""Expert parallelism (`parallel.ep`): each MoE block's experts split over ep ranks, tokens routed by all-to-all.

Mixtral, Qwen3-MoE and DeepSeek-V3 (shared experts, a dense first block) against one plain-torch process on the
same global batch: losses and weights within 1e-5 over 4 steps — ep 4, ep 2 (× dp 2), each with FSDP on the
rest, ep × tp, ep × pp, with clipping; the router's balancing loss over the global batch equal to one process
in every layout; a checkpoint saved at ep 4 resumes at ep 2 under ZeRO-3 and exports for from_pretrained.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from meshkit import Engine
from meshkit.config.layout import Layout, MeshError
from meshkit.config.schema import ParallelConfig
from meshkit.models.facts import ExpertFacts
from meshkit.parallel.expert.apply import ExpertParallelError, check_expert_parallel
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.expert_runs import (
    grads_after_backward,
    plain_loop,
    resume_then_train,
    route_with_capacity,
    save_then_resume,
    train_then_save,
)
from tests.helpers.hf_layouts import batches, build, make_optimizer, rank_part, reference, run_families
from tests.helpers.moe_matrix import EXPERT_CELLS as CELLS  # (DeepSeek's latent attention refuses tp)
from tests.helpers.moe_matrix import (
    GLOBAL_AUX,
    GLOBAL_AUX_FAMILIES,
    GLOBAL_AUX_MORE,
    INTERLEAVED_AUX,
    assert_like_one_process,
    render_moe_matrix,
)
from tests.helpers.moe_models import transformers
from tests.helpers.training import assert_close_relative, assert_state_close

ANY_MODEL_PAGE = Path(__file__).resolve().parents[2] / "docs" / "any-model.md"


def _tier(family: str) -> object:
    """test-quick keeps Mixtral; the other families run in make test, but DeepSeek-V3, whose every part (shared
    experts, a dense first block, latent attention) its low-rank-query variant has too, runs in make test-full."""
    if family == "mixtral":
        return family
    return pytest.param(family, marks=[pytest.mark.slow, *([pytest.mark.sweep] if family == "deepseek_v3" else [])])


@pytest.mark.parametrize("family", [_tier(family) for family in sorted(CELLS)])
def test_moe_models_train_like_one_process_under_expert_parallel(family: str) -> None:
    results = run_world(run_families, 4, {family: CELLS[family]}, timeout=400)
    for layout in CELLS[family]:
        assert_like_one_process(family, layout, results)


@pytest.mark.slow
@pytest.mark.parametrize(  # the suite checks Mixtral's; the other families run in `make test-full`
    "family",
    [
        pytest.param(f"{family}_aux", marks=[] if family == "mixtral" else [pytest.mark.sweep])
        for family in GLOBAL_AUX_FAMILIES
    ],
)
def test_the_global_batch_router_loss_equals_one_process(family: str) -> None:
    cells = [*GLOBAL_AUX, *GLOBAL_AUX_MORE.get(family, ()), "ddp4_aux", "cp2_aux", "tp2_sp_aux", "pp2_aux"]
    results = run_world(run_families, 4, {family: cells}, timeout=400)
    for layout in [*GLOBAL_AUX, *GLOBAL_AUX_MORE.get(family, ())]:
        assert_like_one_process(family, layout, results)
    # per micro-batch (the default): each rank's loss is the model's own on its micro-batch — a quarter of the
    # batch under DDP and under pp 2 × dp 2 (2 pipeline micro-batches of 1 sample on each of 2 data-parallel
    # ranks); under cp 2 (tp 2 + SP) half of it, whose sequences two cp (tp) ranks hold in parts
    model, first = build(family), batches()[0]
    with torch.no_grad():
        quarters = [model(**{k: v[i : i + 1] for k, v in first.items()}).loss.item() for i in range(4)]
        halves = [model(**{k: v[i : i + 2] for k, v in first.items()}).loss.item() for i in (0, 2)]
    whole = reference(family)[0][0]
    got = results[0][family, "ddp4_aux"]["losses"][0]
    assert got == pytest.approx(sum(quarters) / 4, rel=1e-6) and abs(got - whole) > 1e-5
    assert results[0][family, "cp2_aux"]["losses"][0] == pytest.approx(sum(halves) / 2, rel=1e-6)
    assert results[0][family, "tp2_sp_aux"]["losses"][0] == pytest.approx(sum(halves) / 2, rel=1e-6)
    assert results[0][family, "pp2_aux"]["losses"][0] == pytest.approx(sum(quarters) / 4, rel=1e-6)


@pytest.mark.parametrize("layout", [{"ep": 4}, {"ep": 2, "zero_stage": 3}], ids=["ep4", "ep2_zero3"])
def test_the_loop_users_already_have_trains_like_one_process(layout: dict) -> None:
    results = run_world(plain_loop, 4, "qwen3_moe", layout, timeout=300)
    losses, state = reference("qwen3_moe")
    for got in results:  # (every rank's quarter holds as many tokens: the mean of the means is the whole's)
        assert_close_relative(got["losses"], losses, 1e-5)
        assert_state_close(got["state"], state, 1e-5)


def test_a_checkpoint_saved_at_ep4_resumes_at_ep2_and_exports(tmp_path) -> None:
    first, second = {"ep": 4}, {"ep": 2, "zero_stage": 3}
    results = run_world(save_then_resume, 4, "mixtral", first, second, str(tmp_path), timeout=400)
    losses, state = reference("mixtral")
    for got in results:
        assert_close_relative(got["losses"], losses, 1e-5)
        assert_state_close(got["state"], state, 1e-5)
        for name, tensor in got["saved"].items():
            assert torch.equal(tensor, got["resumed"][name]), name
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    saved = results[0]["saved"]
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    plain = build("mixtral")
    plain.load_state_dict(saved)
    ids = batches()[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, plain(ids).logits)


def test_zero2_states_under_ep_resume_at_another_dp_and_refuse_another_form(tmp_path) -> None:
    # saved with each rank's experts chunked over 2 ranks (ep 2 × dp 4), read back chunked over 1 (ep 2 × dp 2)
    saved = str(tmp_path / "state")
    first = run_world(train_then_save, 4, "mixtral", {"ep": 2, "zero_stage": 2}, saved, timeout=300)
    later = {"ep2_zero2": {"ep": 2, "zero_stage": 2}, "ep2_zero3": {"ep": 2, "zero_stage": 3}}
    results = run_world(resume_then_train, 2, "mixtral", later, saved, timeout=300)
    losses, state = reference("mixtral")
    for got in results:
        resumed = got["ep2_zero2"]
        assert_close_relative(first[0] + resumed["losses"], losses, 1e-5)
        assert_state_close(resumed["state"], state, 1e-5)
        refused = got["ep2_zero3"]["refused"]
        assert "saved by ZeRO-1/2 with tp=1, ep=2" in refused, refused
        assert "resume with the saving run's zero_stage, tp and ep (any dp)" in refused, refused


def test_experts_that_receive_no_token_still_get_a_zero_gradient() -> None:
    # the routers start at zero, so every token goes to experts 2 and 3: ep rank 0 (experts 0, 1) receives none,
    # yet it must join backward's all-to-all and reduce gradients of the same shapes as everyone (else: a hang)
    for got in run_world(grads_after_backward, 2, "mixtral_one_sided", {"ep": 2}, timeout=120):
        assert got and all(got.values()), got
    results = run_world(run_families, 4, {"mixtral_one_sided": ["ep4", "ep2_zero3"]}, timeout=300)
    for layout in ("ep4", "ep2_zero3"):  # (and the model's loop over experts trains like one process)
        assert_like_one_process("mixtral_one_sided", layout, results)


def test_the_any_model_page_holds_the_moe_matrix_as_rendered() -> None:
    assert render_moe_matrix() in ANY_MODEL_PAGE.read_text(), (
        "docs/any-model.md's MoE matrix differs: paste "
        "python -c 'from tests.helpers.moe_matrix import render_moe_matrix; print(render_moe_matrix())'"
    )


def test_a_capacity_factor_drops_the_copies_over_an_experts_share() -> None:
    dropless = run_world(route_with_capacity, 1, None, timeout=60)[0]
    assert dropless["send"] == [16] and dropless["out"] == [float(t) for t in range(8)]  # 0.5 + 0.5 of each token
    # 16 copies over 4 experts, factor 1: at most 4 per expert, the earliest tokens first. Expert 0 keeps tokens
    # 0-3 of its 6, expert 1 tokens 0-3 of its 8, expert 2 both of its 2.
    capped = run_world(route_with_capacity, 1, 1.0, timeout=60)[0]
    assert capped["send"] == [10]
    assert capped["kept"] == [0, 2, 4, 6, 1, 3, 5, 7, 12, 14]  # copies (token·2 + choice), by expert
    assert capped["out"] == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 3.0, 3.5]  # dropped copies add nothing
    results = run_world(run_families, 4, {"mixtral": ["ep4_capacity_ample"]}, timeout=300)
    assert_like_one_process("mixtral", "ep4_capacity_ample", results)  # a capacity no expert reaches: dropless


def _facts(experts: int, fused: bool = True) -> ExpertFacts:
    return ExpertFacts("model.layers.0.mlp", "gate", "experts", experts, 2, fused, ("experts.gate_up_proj",))


def test_an_ep_that_does_not_fit_is_one_line_naming_the_choices() -> None:
    with pytest.raises(ExpertParallelError, match=r"ep=4 does not divide the 6 experts of model.layers.0.mlp: "
                       r"choose 1 or 2$"):  # fmt: skip
        check_expert_parallel((_facts(6),), 4, 4, "auto")
    with pytest.raises(ExpertParallelError, match="are a list of modules"):
        check_expert_parallel((_facts(4, fused=False),), 2, 4, "auto")
    uneven = replace(_facts(4), uneven=True)  # (LongCat: gate/up rows for its zero-computation experts too)
    with pytest.raises(ExpertParallelError, match="holds different expert counts .* set parallel.ep=1$"):
        check_expert_parallel((uneven,), 2, 4, "auto")
    with pytest.raises(MeshError, match=r"ep=3 must divide the 4 ranks .* choose 1, 2 or 4"):
        Layout.from_config(ParallelConfig(ep=3), 4)
    assert Layout.from_config(ParallelConfig(ep=2, tp=2, dp_replicate=-1), 8).describe() == (
        "dp_replicate4 × tp2, experts over ep2"
    )


def test_the_global_balancing_loss_follows_interleaved_schedules() -> None:
    results = run_world(run_families, 4, INTERLEAVED_AUX, timeout=300)
    for family, layouts in INTERLEAVED_AUX.items():
        for layout in layouts:
            assert_like_one_process(family, layout, results)


def refusals_under_zbv(rank: int) -> tuple[str, str]:
    """(preparing a 4-block Mixtral with the balancing loss, engine.eval_token_loss of llama) in zbv_zero_bubble
    pipelines: each one line."""
    from tests.helpers.moe_models import ROUTER_LOSS, moe_causal_lm

    torch.distributed.init_process_group("gloo")
    out = []
    for model in (moe_causal_lm("mixtral", num_hidden_layers=4, **ROUTER_LOSS), build("llama")):
        engine = Engine(seed=0, pp=2, schedule="zbv_zero_bubble", microbatches=2, router_aux_loss="global_batch")
        try:
            engine.prepare(model, make_optimizer(model))
            engine.eval_token_loss(rank_part(engine, batches()[0]))
            out.append("")
        except Exception as err:  # noqa: BLE001 - the refusal is the result
            out.append(str(err))
        engine.end()
    leave_world()
    return out[0], out[1]


def test_forward_only_passes_are_refused_in_one_line_under_the_v_schedule() -> None:
    """torch's zbv_zero_bubble runs gradient hand-overs between a rank's two stages even in eval (an assertion
    inside torch): the balancing loss's counting pass and evaluation say so and name the schedule to use."""
    balancing, evaluation = run_world(refusals_under_zbv, 4, timeout=200)[0]
    assert balancing.startswith("the router's balancing loss (it counts the routing first) runs a forward-only")
    assert evaluation.startswith("evaluation runs a forward-only pass")
    assert all("interleaved_zero_bubble" in m and "\n" not in m for m in (balancing, evaluation))
