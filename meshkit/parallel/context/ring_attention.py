"""Ring attention for context parallel, on any backend (gloo on CPU, NCCL on CUDA).

Each of the `cp` ranks holds 2 of the sequence's 2·cp chunks: rank i holds chunks i and 2·cp−1−i, so under a
causal mask every rank does the same amount of work. Keys and values travel around the ring (async send/recv
posted before the local block is computed, so the transfer overlaps the compute); each query chunk merges the
partial results block by block with the online softmax (running log-sum-exp). The backward pass is a custom
autograd Function that recomputes the block scores from the saved log-sum-exp and sends each key/value block's
gradient around the ring with it, back to its owner.

Shapes: q, k, v, out are [batch, heads, local_seq, head_dim] with local_seq = 2 chunks; lse is [batch, heads,
local_seq].
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks rank `rank` holds (load-balanced for causal attention)."""
    return rank, 2 * cp - 1 - rank


def _mask_kind(q_chunk: int, kv_chunk: int, causal: bool) -> str | None:
    """'full', 'causal' (the diagonal block) or None (entirely in the future: skipped)."""
    if not causal or kv_chunk < q_chunk:
        return "full"
    return "causal" if kv_chunk == q_chunk else None


def _scores(q: torch.Tensor, k: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # [batch, heads, n, m]
    if kind == "causal":
        n, m = scores.shape[-2:]
        future = torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


class _Ring:
    """Send to the next rank of the cp group, receive from the previous one (async)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(works: list[dist.Work]) -> None:
        for work in works:
            work.wait()


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = _Ring(group)
    half = q.shape[2] // 2
    q_ids = chunk_ids(ring.rank, ring.size)
    q_parts = (q[:, :, :half], q[:, :, half:])
    outs = [torch.zeros_like(part, dtype=torch.float32) for part in q_parts]
    lses = [torch.full(part.shape[:-1], float("-inf"), device=q.device) for part in q_parts]
    kv = torch.stack((k, v))  # [2, batch, heads, local_seq, head_dim]
    for step in range(ring.size):
        pending = ring.start(kv) if step < ring.size - 1 else None  # next block arrives during this compute
        kv_ids = chunk_ids((ring.rank - step) % ring.size, ring.size)
        for a, q_part in enumerate(q_parts):
            for b, kv_chunk in enumerate(kv_ids):
                kind = _mask_kind(q_ids[a], kv_chunk, causal)
                if kind is None:
                    continue
                scores = _scores(q_part, kv[0][:, :, b * half : (b + 1) * half], kind, scale)
                block_lse = torch.logsumexp(scores, dim=-1)
                block_out = torch.matmul(
                    torch.exp(scores - block_lse[..., None]), kv[1][:, :, b * half : (b + 1) * half].float()
                )
                merged = torch.logaddexp(lses[a], block_lse)  # online softmax: rescale both parts to the new total
                outs[a] = (
                    outs[a] * torch.exp(lses[a] - merged)[..., None]
                    + block_out * torch.exp(block_lse - merged)[..., None]
                )
                lses[a] = merged
        if pending is not None:
            kv, works = pending
            ring.finish(works)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def ring_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = _Ring(group)
    half = q.shape[2] // 2
    q_ids = chunk_ids(ring.rank, ring.size)
    grad_q = torch.zeros_like(q, dtype=torch.float32)
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # [batch, heads, local_seq]: rowsum(dO ∘ O)
    kv = torch.stack((k, v))
    grad_kv = torch.zeros_like(kv, dtype=torch.float32)  # travels with the block back to its owner
    for step in range(ring.size):
        pending = ring.start(kv) if step < ring.size - 1 else None
        kv_ids = chunk_ids((ring.rank - step) % ring.size, ring.size)
        for a in range(2):
            rows = slice(a * half, (a + 1) * half)
            for b, kv_chunk in enumerate(kv_ids):
                kind = _mask_kind(q_ids[a], kv_chunk, causal)
                if kind is None:
                    continue
                cols = slice(b * half, (b + 1) * half)
                k_block, v_block = kv[0][:, :, cols].float(), kv[1][:, :, cols].float()
                probs = torch.exp(_scores(q[:, :, rows], k_block, kind, scale) - lse[:, :, rows, None])
                d_out = grad_out[:, :, rows].float()
                grad_kv[1][:, :, cols] += torch.matmul(probs.transpose(-2, -1), d_out)
                d_scores = probs * (torch.matmul(d_out, v_block.transpose(-2, -1)) - delta[:, :, rows, None])
                grad_q[:, :, rows] += torch.matmul(d_scores, k_block) * scale
                grad_kv[0][:, :, cols] += torch.matmul(d_scores.transpose(-2, -1), q[:, :, rows].float()) * scale
        # This block's gradient moves on with it; the one for the next block arrives from the previous rank.
        grad_kv, works = ring.start(grad_kv)
        ring.finish(works)
        if pending is not None:
            kv, works = pending
            ring.finish(works)
    return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):  # type: ignore[override]
        out, lse = ring_forward(q, k, v, group, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring_backward(grad_out, q, k, v, out, lse, ctx.group, ctx.causal, ctx.scale)
        return (*grads, None, None, None)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's two query chunks over the whole (ring-distributed) sequence.

    `scale` multiplies the scores (default 1/sqrt(head_dim), as in scaled dot-product attention).
    """
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {q.shape[2]}")
    return RingAttention.apply(q, k, v, group, causal, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
