"""ZeRO-1/2 reducing gradients in buckets during backward: the bucket plan, the same weights as DDP (with and
without accumulation, either accumulation mode, clipping, token weighting, tiny buckets, tensor parallel),
full gradients freed as their buckets are reduced, and resident memory flat over 20 steps on every stage."""

from __future__ import annotations

import pytest
import torch

from meshkit import Engine
from meshkit.config import RunConfig
from meshkit.models.gpt import lm_loss
from meshkit.parallel.zero.buckets import IN_FLIGHT, plan_buckets
from meshkit.parallel.zero.optimizer import ZeroOptimizer
from meshkit.runtime.host_memory import WARMUP_STEPS
from meshkit.runtime.memory import current_rss_bytes
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.training import assert_state_close, make_optimizer, split, tiny_gpt, token_batches

SMALL_BUCKET_MB = 0.02  # ~5k fp32 elements: tiny GPT's gradients span many buckets, several per rank's chunk


def test_buckets_follow_backward_order_and_never_straddle_a_ranks_chunk() -> None:
    slices = [(0, 10), (10, 30), (40, 5), (45, 25)]  # 70 elements, 4 parameters
    buckets = plan_buckets(slices, chunk=18, bucket_numel=20)
    assert buckets[0].end == 70 and buckets[-1].start == 0  # the last parameters first
    covered = sorted((b.start, b.end) for b in buckets)
    assert [a for a, _ in covered][1:] == [b for _, b in covered][:-1]  # contiguous, no gaps, no overlaps
    for bucket in buckets:
        assert bucket.start // 18 == (bucket.end - 1) // 18 == bucket.owner  # one owner per bucket
        assert all(slices[i][0] < bucket.end and sum(slices[i]) > bucket.start for i in bucket.members)
    assert {0, 18, 36, 54}.issubset({b.start for b in buckets})  # cut at every chunk boundary


LAYOUTS = {
    "ddp": {},
    "zero1": {"zero_stage": 1},
    "zero1_once": {"zero_stage": 1, "zero": {"reduce_every_micro_step": False}},
    "zero1_each": {"zero_stage": 1, "zero": {"reduce_every_micro_step": True}},
    "zero2": {"zero_stage": 2},
    "zero2_once": {"zero_stage": 2, "zero": {"reduce_every_micro_step": False}},
}


def _train(rank: int, world: int, accum: int, weighted: bool, tp: int = 1, clip: float | None = 0.05) -> dict:
    torch.distributed.init_process_group("gloo")
    out = {}
    for name, overrides in LAYOUTS.items():
        zero = {"bucket_mb": SMALL_BUCKET_MB, **overrides.get("zero", {})}
        settings = {k: v for k, v in overrides.items() if k != "zero"}
        engine = Engine(seed=0, grad_accum_steps=accum, max_grad_norm=clip, zero=zero, tp=tp, **settings)
        model = tiny_gpt()
        model, optimizer = engine.prepare(model, make_optimizer(model))
        per_rank, replica = 2, engine.dp_rank  # tensor-parallel peers see the same rows
        for batch in token_batches(3 * accum, per_rank * engine.dp_size):
            inputs, targets = split(batch[replica * per_rank : (replica + 1) * per_rank])
            with engine.accumulate():
                with engine.loss_parallel():  # tp: vocab-sharded logits
                    loss = lm_loss(model(inputs), targets)
                if weighted:  # token-weighted: summed loss with its item count
                    engine.backward(loss * targets.numel(), num_items=targets.numel() * (rank + 1))
                else:
                    engine.backward(loss)
                if clip is not None:
                    engine.clip_grad_norm_(clip)
                optimizer.step()
                optimizer.zero_grad()
        out[name] = engine.full_state_dict()
        engine.end()
    leave_world()
    return out


def test_bucketed_zero_1_and_2_end_at_ddp_weights_with_accumulation_and_clipping() -> None:
    # Token-weighted without clipping too: a clipped step hides a gradient scaled twice (ZeRO-1 once did that to
    # every weighted gradient, which every transformers model's loss is).
    for accum, weighted, clip in ((2, False, 0.05), (1, True, 0.05), (1, True, None)):
        result = run_world(_train, 4, 4, accum, weighted, 1, clip, timeout=240)[0]
        for name in LAYOUTS:  # (unclipped steps are larger: rounding of another reduction order shows more)
            assert_state_close(result[name], result["ddp"], 1e-6 if clip else 1e-5)


def test_bucketed_zero_1_and_2_with_tensor_parallel_gradients_end_at_ddp_weights() -> None:
    result = run_world(_train, 4, 4, 2, False, 2, timeout=240)[0]  # tp 2 x dp 2: DTensor gradients in buckets
    for name in LAYOUTS:
        assert_state_close(result[name], result["ddp"], 1e-6)


def _freed(rank: int) -> dict:
    engine = Engine(seed=0, zero_stage=2, grad_accum_steps=2, zero={"bucket_mb": SMALL_BUCKET_MB})
    model = tiny_gpt()
    model, optimizer = engine.prepare(model, make_optimizer(model))
    zero = optimizer.optimizer
    assert isinstance(zero, ZeroOptimizer)
    reducer = zero.shards[0].bucketed
    seen: list[int] = []  # bucket buffers alive whenever a gradient arrives during backward
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: seen.append(len(reducer._buffers)))
    inputs, targets = split(token_batches(1, 4)[0][rank * 2 : rank * 2 + 2])
    with engine.accumulate():  # a micro-step that does not end the window
        engine.backward(lm_loss(model(inputs), targets))
    held = [p for p in model.parameters() if p.grad is not None]
    report = engine.memory_report()
    engine.end()
    return {
        "params_with_grad": len(held),
        "full": reducer.full is not None,
        "buffers_after": len(reducer._buffers),
        "most_buffers": max(seen),
        "grads_bytes": report["grads"],
        "chunk_bytes": zero.shards[0].chunk * 4,
        "buckets": len(reducer.buckets),
    }


def test_stage_2_frees_each_full_gradient_once_its_bucket_is_reduced() -> None:
    for result in run_world(_freed, 2, timeout=120):
        assert result["buckets"] > 2 * IN_FLIGHT
        assert result["params_with_grad"] == 0 and not result["full"] and result["buffers_after"] == 0
        assert result["most_buffers"] <= IN_FLIGHT + 1  # never the full gradients, a couple of buckets at most
        assert result["grads_bytes"] == result["chunk_bytes"]  # this rank's chunk is all it keeps


def _stage_1(rank: int) -> dict:
    """Two steps of stage 1: which collectives reduce the gradients, what `.grad` shows, where the buffer lives."""
    engine = Engine(seed=0, zero_stage=1, zero={"bucket_mb": SMALL_BUCKET_MB})
    model = tiny_gpt()
    model, optimizer = engine.prepare(model, make_optimizer(model))
    reducer = optimizer.optimizer.shards[0].bucketed
    calls: list[str] = []
    for name in ("reduce", "all_reduce"):
        original = getattr(torch.distributed, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(torch.distributed, name, counted)
    buffers, grads_after_backward = [], []
    for batch in token_batches(2, 4):
        inputs, targets = split(batch[rank * 2 : rank * 2 + 2])
        engine.backward(lm_loss(model(inputs), targets))
        grads_after_backward.append(sum(p.grad is not None for p in model.parameters()))
        buffers.append(reducer.full.data_ptr())
        optimizer.step()
        optimizer.zero_grad()
    engine.end()
    return {"calls": calls, "buffers": buffers, "grads": grads_after_backward, "buckets": len(reducer.buckets)}


def test_stage_1_reduces_each_bucket_to_its_owner_into_a_buffer_kept_between_steps() -> None:
    """The ZeRO paper's P_os: each rank steps its own chunk, so an all-reduce would send every gradient twice.
    Outside its chunk a rank's buffer holds its own sums afterwards, so no parameter's `.grad` shows them."""
    for result in run_world(_stage_1, 2, timeout=120):
        assert result["calls"].count("reduce") == 2 * result["buckets"]  # every bucket, both steps
        assert "all_reduce" not in result["calls"][: result["buckets"]]  # (clipping's norm is one scalar later)
        assert result["grads"] == [0, 0]
        assert result["buffers"][0] == result["buffers"][1]  # allocated once, zeroed as the next window starts


def _rss(rank: int) -> dict[int, list[float]]:
    """Resident MB after each of 20 steps of a 6.3 M-parameter stack (SGD with momentum), every stage in turn."""
    torch.distributed.init_process_group("gloo")
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
        engine = Engine(seed=0, zero_stage=stage, hang_doctor=False)
        model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        inputs, sizes = torch.randn(64, 1024), []
        for _ in range(20):
            engine.backward(model(inputs).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            sizes.append(current_rss_bytes() / 2**20)
        engine.end()
        del model, optimizer, engine
        out[stage] = sizes
    leave_world()
    return out


@pytest.mark.slow
def test_resident_memory_stays_flat_over_20_steps_on_every_stage() -> None:
    slack = RunConfig().host_memory_slack_mb or 0.0
    for rank, stages in enumerate(run_world(_rss, 4, timeout=180)):
        for stage, sizes in stages.items():
            growth = max(sizes[WARMUP_STEPS:]) - max(sizes[:WARMUP_STEPS])
            assert growth <= slack + 4, f"stage {stage} rank {rank}: RSS grew {growth:.1f} MB after warm-up: {sizes}"


def _pipeline(rank: int) -> dict:
    """pp 2 × dp 2 with ZeRO 0, 1, 2 (reduced after the schedule), three optimizer steps each."""
    torch.distributed.init_process_group("gloo")
    out = {}
    for stage in (0, 1, 2):
        engine = Engine(seed=0, pp=2, zero_stage=stage, pipeline={"microbatches": 2})
        model = tiny_gpt()
        initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        model, _ = engine.prepare(model, make_optimizer(model), loss_fn=lm_loss)
        for batch in token_batches(3, 8):
            engine.train_step(split(batch[engine.dp_rank * 4 : engine.dp_rank * 4 + 4]))
        out[stage] = engine.full_state_dict()
        engine.end()
    leave_world()
    out["initial"] = initial
    return out


def test_pipeline_stages_with_zero_1_and_2_train_like_zero_0() -> None:
    result = run_world(_pipeline, 4, timeout=180)[0]
    assert all(not torch.equal(result[0][name], result["initial"][name]) for name in result["initial"])
    for stage in (1, 2):  # (the after-schedule reduce once found no gradients here and stepped on none)
        assert_state_close(result[stage], result[0], 1e-6)
