"""The fused linear cross-entropy (`meshkit.training.fused_cross_entropy`) and the head that computes it in its own
forward (`meshkit.training.fused_head`): the same loss and gradients as the logits' cross-entropy, in one process,
over a vocab-sharded head, and through the engine in every layout that computes the loss from a head."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshkit.training.fused_cross_entropy import VocabShard, chunk_tokens, fused_linear_cross_entropy
from meshkit.training.fused_head import FusedHead
from meshkit.training.token_weights import entropy_weights
from tests.helpers.distributed import gloo_world, run_world

TOKENS, HIDDEN, VOCAB = 50, 16, 96


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3
    bias = torch.randn(VOCAB, generator=generator)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    targets[::5] = -100
    return hidden, weight, bias, targets


def _loss_and_grads(compute: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [tensor.clone().requires_grad_() for tensor in tensors]
    loss = compute(*leaves)
    (loss * 0.7).backward()  # (a gradient other than 1 reaches the loss)
    return loss.detach(), [leaf.grad for leaf in leaves]  # type: ignore[misc]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_chunks_are_as_large_as_the_byte_budget_allows_but_never_fewer_tokens_than_the_hidden_size() -> None:
    assert chunk_tokens(vocab_rows=1000, hidden=16, tokens=10_000, chunk_bytes=4 * 1000 * 64) == 64
    assert chunk_tokens(vocab_rows=1000, hidden=256, tokens=10_000, chunk_bytes=4 * 1000 * 64) == 256
    assert chunk_tokens(vocab_rows=1000, hidden=256, tokens=100, chunk_bytes=4 * 1000 * 64) == 100


@pytest.mark.parametrize("chunk_bytes", [4 * VOCAB * 7, 2**30], ids=["many-chunks", "one-chunk"])
def test_the_fused_loss_and_its_gradients_equal_the_logits_cross_entropy(chunk_bytes: int) -> None:
    hidden, weight, bias, targets = _inputs()

    def plain(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w, b), targets, ignore_index=-100, reduction="sum")

    def fused(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(h, w, targets, bias=b, chunk_bytes=chunk_bytes)

    want, want_grads = _loss_and_grads(plain, hidden, weight, bias)
    got, got_grads = _loss_and_grads(fused, hidden, weight, bias)
    assert float((got - want).abs() / want.abs()) < 1e-6
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert _relative(got_grad, want_grad) < 1e-6


def test_token_weights_are_read_from_each_chunks_logits_and_frozen_inputs_get_no_gradient() -> None:
    hidden, weight, _, targets = _inputs(1)
    eaft = entropy_weights(alpha=1.0, k=5)
    logits = F.linear(hidden, weight)
    with torch.no_grad():
        scale = eaft(logits, targets) * (targets != -100)
    per_token = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    want = (per_token * scale).sum()
    leaf = hidden.clone().requires_grad_()
    got = fused_linear_cross_entropy(leaf, weight, targets, token_weights=eaft, chunk_bytes=4 * VOCAB * 16)
    assert float((got.detach() - want).abs() / want) < 1e-6
    got.backward()
    assert leaf.grad is not None and weight.grad is None  # (the weight was not asked for a gradient)
    with torch.no_grad():  # evaluation: the loss alone
        assert float(fused_linear_cross_entropy(hidden, weight, targets, token_weights=eaft)) == pytest.approx(
            float(want), rel=1e-6
        )


def test_under_autocast_the_head_runs_in_the_autocast_dtype_like_the_plain_head() -> None:
    hidden, weight, _, targets = _inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-100, reduction="sum")
        got = fused_linear_cross_entropy(hidden, weight, targets)
    assert float((got - want).abs() / want) < 1e-6  # (the same bf16 logits, then fp32)
    assert float((got - fused_linear_cross_entropy(hidden, weight, targets)).abs() / want) > 1e-6  # fp32 differs


def _vocab_parallel(rank: int) -> dict[str, Any]:
    """Each rank holds half the vocabulary's rows; the loss and the hidden states' gradient are the whole's."""
    with gloo_world():
        hidden, weight, bias, targets = _inputs()
        rows = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
        shard = VocabShard(dist.group.WORLD, rows.start)  # type: ignore[arg-type]

        def fused(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return fused_linear_cross_entropy(h, w, targets, bias=b, shard=shard, chunk_bytes=4 * VOCAB * 7)

        loss, grads = _loss_and_grads(fused, hidden, weight[rows], bias[rows])
        return {"loss": loss, "hidden": grads[0], "weight": grads[1], "bias": grads[2], "rows": (rows.start, rows.stop)}


@pytest.mark.world
def test_a_vocab_sharded_head_gives_the_whole_vocabularys_loss_and_gradients() -> None:
    hidden, weight, bias, targets = _inputs()

    def plain(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w, b), targets, ignore_index=-100, reduction="sum")

    want, (want_hidden, want_weight, want_bias) = _loss_and_grads(plain, hidden, weight, bias)
    for result in run_world(_vocab_parallel, 2, timeout=120):
        rows = slice(*result["rows"])
        assert float((result["loss"] - want).abs() / want) < 1e-6
        assert _relative(result["hidden"], want_hidden) < 1e-6
        assert _relative(result["weight"], want_weight[rows]) < 1e-6
        assert _relative(result["bias"], want_bias[rows]) < 1e-6


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(hidden)))


def _tensor_parallel_head(rank: int) -> dict[str, Any]:
    """A column-split head with vocab-sharded DTensor output (loss parallel): the head's forward gets its input and
    weight as DTensors; the fused loss equals loss_parallel's cross-entropy of the sharded logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    with gloo_world():
        mesh = init_device_mesh("cpu", (2,))
        hidden, _, _, targets = _inputs(3)
        results = {}
        for fused in (False, True):
            model = _TinyLM()
            style = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            parallelize_module(model, mesh, {"head": style})
            head = FusedHead(model.head) if fused else None
            with loss_parallel():
                if head is not None:
                    with head.loss_of(targets):
                        logits = model(hidden)
                    loss = head.take_loss(logits)
                else:
                    loss = F.cross_entropy(model(hidden), targets, ignore_index=-100, reduction="sum")
                assert loss is not None
                loss.backward()
            full = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            results[fused] = {"loss": full.detach(), "body": model.body.weight.grad.detach(),
                              "head": model.head.weight.grad.full_tensor().detach()}  # fmt: skip
        return results


@pytest.mark.world
def test_the_fused_head_under_tensor_parallel_equals_loss_parallel() -> None:
    for result in run_world(_tensor_parallel_head, 2, timeout=120):
        plain, fused = result[False], result[True]
        assert float((fused["loss"] - plain["loss"]).abs() / plain["loss"]) < 1e-6
        assert _relative(fused["body"], plain["body"]) < 1e-6
        assert _relative(fused["head"], plain["head"]) < 1e-6


def test_outside_loss_of_the_head_is_itself() -> None:
    model = _TinyLM()
    hidden, _, _, targets = _inputs()
    want = model(hidden)
    fused = FusedHead(model.head)
    assert torch.equal(model(hidden), want)  # (evaluation, generation)
    with fused.loss_of(targets):
        stand_in = model(hidden)
    assert stand_in.shape == (TOKENS, 0)
    loss = fused.take_loss(stand_in)
    assert loss is not None and fused.take_loss(stand_in) is None  # (taken once)
    with fused.loss_of(targets * 0):
        model(hidden)  # (a step that failed before its loss was taken)
    with fused.loss_of(targets):
        again = fused.take_loss(model(hidden))
    assert again is not None and float(again) == pytest.approx(float(loss))  # (this forward's, not the stale one)
    fused.remove()
    assert "forward" not in model.head.__dict__ and torch.equal(model(hidden), want)


def _local_weights(rank: int) -> dict[str, bool]:
    """What the fused head computes against for each kind of DTensor head weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshkit.training.fused_head import _local, _vocab_shard

    with gloo_world():
        weight = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
        flat, square = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (1, 2))
        rows = distribute_tensor(weight, flat, [Shard(0)])  # vocab-parallel: this rank's rows, its shard named
        whole = distribute_tensor(weight, flat, [Replicate()])
        nested = distribute_tensor(weight, square, [Shard(0), Shard(0)])  # a 2-D split: gathered whole
        return {
            "rows": torch.equal(_local(rows), weight[rank * 4 : (rank + 1) * 4]),
            "shard": _vocab_shard(rows) is not None and _vocab_shard(rows).start == rank * 4,
            "replicated": torch.equal(_local(whole), weight) and _vocab_shard(whole) is None,
            "nested": torch.equal(_local(nested), weight) and _vocab_shard(nested) is None,
        }


@pytest.mark.world
def test_a_head_weight_is_read_as_its_rows_when_split_over_the_vocabulary_and_whole_otherwise() -> None:
    for result in run_world(_local_weights, 2, timeout=120):
        assert result == {"rows": True, "shard": True, "replicated": True, "nested": True}
