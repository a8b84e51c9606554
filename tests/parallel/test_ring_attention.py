"""Ring attention equals full attention (output and q/k/v gradients, fp32, <= 1e-5) at cp = 2 and 4: causal and
not, with a sliding window, over packed rows (samples kept apart by position_ids), with attention sinks, and with
values narrower than the keys (latent attention)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshkit.parallel.context.apply import shard_sequence
from meshkit.parallel.context.ring_attention import ring_attention
from meshkit.parallel.context.visibility import Visibility, chunk_index
from tests.helpers.distributed import leave_world, run_world

BATCH, HEADS, SEQ, DIM = 2, 3, 16, 8
PACKED = ((5, 7, 4), (3, 9, 4))  # sample lengths of each row of a packed batch


def full_inputs() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator) for _ in range(4))
    sinks = torch.randn(HEADS, generator=generator)
    return q, k, v, grad, sinks


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKED])


def reference_attention(q, k, v, window, positions, sinks, softcap):  # type: ignore[no-untyped-def]
    """Attention as transformers' eager code computes it: a dense mask, soft-capped scores, sinks as an extra
    softmax column."""
    index = torch.arange(SEQ)
    distance = index[:, None] - index[None, :]
    seen = (distance >= 0) & ((distance < window) if window else True)
    seen = seen.expand(BATCH, 1, SEQ, SEQ)
    if positions is not None:
        starts = index[None] - positions
        seen = seen & (starts[:, :, None] == starts[:, None, :])[:, None]
    scores = q @ k.transpose(-2, -1) / math.sqrt(DIM)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks[None, :, None, None].expand(BATCH, -1, SEQ, 1)), dim=-1)
    return torch.softmax(scores, dim=-1)[..., :SEQ] @ v


def narrowed(case: dict, v: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (and the output's gradient) of `value_dim` features: narrower than the keys, as in latent attention."""
    width = case.get("value_dim", DIM)
    return v[..., :width].contiguous(), grad[..., :width].contiguous()


def ring_case(rank: int, cp: int, case: dict) -> dict:
    q, k, v, grad, sinks = full_inputs()
    v, grad = narrowed(case, v, grad)
    q, k, v, grad = (shard_sequence(t, cp, rank, dim=2) for t in (q, k, v, grad))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_() if case.get("sinks") else None
    positions = shard_sequence(packed_positions(), cp, rank, dim=1) if case.get("packed") else None
    out = ring_attention(
        q,
        k,
        v,
        dist.group.WORLD,
        causal=case["causal"],
        window=case.get("window"),
        position_ids=positions,
        sinks=sinks,
        softcap=case.get("softcap"),
    )
    out.backward(grad)
    result = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return result if sinks is None else {**result, "dsinks": sinks.grad}


def ring_rank(rank: int, cases: dict[str, dict]) -> dict[str, dict]:
    """Every case in one world (a world per case would spend its time starting processes)."""
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    out = {name: ring_case(rank, cp, case) for name, case in cases.items()}
    leave_world()
    return out


CASES = {
    "causal": {"causal": True},
    "bidirectional": {"causal": False},
    "window3": {"causal": True, "window": 3},
    "window6": {"causal": True, "window": 6},
    "packed": {"causal": True, "packed": True},
    "packed_window3": {"causal": True, "packed": True, "window": 3},
    "sinks_window5": {"causal": True, "sinks": True, "window": 5},
    "softcap_window3": {"causal": True, "softcap": 0.5, "window": 3},
    "narrow_values": {"causal": True, "value_dim": DIM // 2},  # DeepSeek's latent attention: v narrower than q, k
}


def expected(settings: dict) -> dict[str, torch.Tensor]:
    q, k, v, grad, sinks = full_inputs()
    v, grad = narrowed(settings, v, grad)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_() if settings.get("sinks") else None
    if settings["causal"]:
        positions = packed_positions() if settings.get("packed") else None
        out = reference_attention(q, k, v, settings.get("window"), positions, sinks, settings.get("softcap"))
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    out.backward(grad)
    reference = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return reference if sinks is None else {**reference, "dsinks": sinks.grad}


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_attention(cp: int) -> None:
    results = run_world(ring_rank, cp, CASES, timeout=120)
    for case, settings in CASES.items():
        reference = expected(settings)
        for rank, by_case in enumerate(results):
            for name, tensor in by_case[case].items():
                if name == "dsinks":
                    continue
                local = shard_sequence(reference[name], cp, rank, dim=2)
                torch.testing.assert_close(tensor, local, rtol=1e-5, atol=1e-5, msg=f"{case}: {name} on rank {rank}")
        if "dsinks" in reference:  # each rank's sink gradient is its queries' share: they sum to the whole
            total = torch.stack([by_case[case]["dsinks"] for by_case in results]).sum(dim=0)
            torch.testing.assert_close(total, reference["dsinks"], rtol=1e-5, atol=1e-5, msg=case)


def test_a_sliding_window_exchanges_fewer_blocks() -> None:
    """cp 4, chunks of 2 tokens: a window of 3 needs only the neighbouring chunks (offsets 1 and 3), and a
    window wider than the sequence needs every offset, like full causal attention."""
    assert Visibility().offsets(4, 2) == [0, 1, 2, 3]
    assert Visibility(window=3).offsets(4, 2) == [0, 1, 3]
    assert Visibility(window=64).offsets(4, 2) == [0, 1, 2, 3]
    assert Visibility(window=1).offsets(4, 2) == [0]


@pytest.mark.parametrize("causal", [True, False])
def test_block_kinds_from_chunk_numbers_agree_with_the_dense_mask(causal: bool) -> None:
    """What a block's queries see of its keys is decided from the chunk numbers alone (no device sync): it must
    be what the dense mask of those positions says."""
    half = 4
    for window in (None, 1, 2, 3, 4, 5, 8, 9, 13):
        visibility = Visibility(causal=causal, window=window)
        for q in range(6):
            for k in range(6):
                dense = visibility.geometric(chunk_index(q, half, None), chunk_index(k, half, None))
                expected = "none" if not dense.any() else "all" if dense.all() else "some"
                assert visibility.chunk_pair(q, k, half) == expected, (causal, window, q, k)


def test_a_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 position"):
        ring_attention(*(torch.zeros(1, 1, 4, 2) for _ in range(3)), group=None, window=0)  # type: ignore[arg-type]


def test_attention_inputs_ring_attention_cannot_split_are_refused_in_one_line() -> None:
    """Keys beyond the sequence (a compressed memory) and a float tensor of the model's own (a position bias) stop
    the first call; the batch's integer tensors pass on to the rest of the checks."""
    from meshkit.parallel.context.hf import RingAttentionError, ring_attention_function

    module, query = torch.nn.Module(), torch.zeros(1, 2, 4, 8)
    with pytest.raises(RingAttentionError, match=r"attends over 6 keys for 4 queries .* use cp=1$"):
        ring_attention_function(module, query, torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), None)
    bias = torch.zeros(1, 2, 4, 4)
    with pytest.raises(RingAttentionError, match=r"passes position_bias to its attention function .* use cp=1$"):
        ring_attention_function(module, query, query, query, None, position_bias=bias)
    labels = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RingAttentionError, match="none of the attention modules"):  # (past the input checks)
        ring_attention_function(module, query, query, query, None, shift_labels=labels, position_ids=labels)
