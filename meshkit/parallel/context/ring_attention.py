"""Ring attention for context parallel, on any backend (gloo on CPU, NCCL on CUDA).

Each of the `cp` ranks holds 2 of the sequence's 2·cp chunks: rank i holds chunks i and 2·cp−1−i, so under a
causal mask every rank does the same amount of work. Every rank sends its keys and values to the rank `offset`
places after it, for each offset some query needs (`visibility.Visibility.offsets`: all of them for full causal
attention, a few for a sliding window); the next block's exchange is posted before the current block is computed,
so the transfer overlaps the compute. Each query chunk merges the partial results block by block with the online
softmax (running log-sum-exp); soft-capped scores (Gemma-2) are capped block by block. Attention sinks
(gpt-oss: one learned logit per head that takes softmax mass and adds no value) join the log-sum-exp at the end.
The backward pass is a custom autograd Function that recomputes the block scores from the saved log-sum-exp and
sends each key/value block's gradient straight back to its owner.

Packed rows keep their samples apart through `position_ids` (see `visibility`): their sample starts travel with
the keys and values.

Shapes: q, k, v, out are [batch, heads, local_seq, head_dim] with local_seq = 2 chunks; lse is [batch, heads,
local_seq]; position_ids [batch, local_seq]; sinks [heads].
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshkit.parallel.context.visibility import Visibility, block_mask, chunk_ids, chunk_index


@dataclass
class _Block:
    """One rank's keys and values side by side ([batch, heads, local_seq, k_dim + v_dim]: their widths may differ,
    as in DeepSeek's latent attention), with their packed-sample starts."""

    kv: torch.Tensor
    starts: torch.Tensor | None


class _Exchange:
    """Direct sends between the ranks of the cp group: to the rank `offset` after, from the one `offset` before."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def start(self, tensors: list[torch.Tensor], offset: int) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Send `tensors` `offset` ranks ahead; receive the same shapes from `offset` ranks behind (async)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for tensor, into in zip(tensors, received, strict=True):
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), self._peer(offset), self.group))
            ops.append(dist.P2POp(dist.irecv, into, self._peer(-offset), self.group))
        return received, dist.batch_isend_irecv(ops)

    def send_block(self, block: _Block, offset: int) -> tuple[list[torch.Tensor], list[dist.Work]]:
        return self.start([block.kv] if block.starts is None else [block.kv, block.starts], offset)

    @staticmethod
    def finish(pending: tuple[list[torch.Tensor], list[dist.Work]]) -> list[torch.Tensor]:
        received, works = pending
        for work in works:
            work.wait()
        return received

    def blocks(self, own: _Block, offsets: list[int]) -> Iterator[tuple[int, _Block]]:
        """(offset, the block of the rank `offset` before) for each offset in turn, `own` first; the next block's
        exchange is posted before the current one is handed out, so the transfer overlaps its compute."""
        pending = self.send_block(own, offsets[1]) if len(offsets) > 1 else None
        for step, offset in enumerate(offsets):
            if not offset:
                yield offset, own
                continue
            assert pending is not None  # (posted for every offset after the first)
            block = _as_block(self.finish(pending))
            pending = self.send_block(own, offsets[step + 1]) if step + 1 < len(offsets) else None
            yield offset, block


def _as_block(tensors: list[torch.Tensor]) -> _Block:
    return _Block(tensors[0], tensors[1] if len(tensors) > 1 else None)


def _local_index(rank: int, cp: int, half: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = (chunk_index(chunk, half, device) for chunk in chunk_ids(rank, cp))
    return first, second


@dataclass(frozen=True)
class _Scoring:
    """Block scores: q·kᵀ · scale, soft-capped (cap · tanh(s / cap), Gemma-2) when `softcap` is set, masked."""

    scale: float
    softcap: float | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * self.scale  # [batch, heads, n, m]
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        return scores if mask is None else scores.masked_fill(~mask, float("-inf"))

    def raw_gradient(self, d_scores: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The gradient of q·kᵀ · scale from the gradient of the (capped) scores."""
        if not self.softcap:
            return d_scores
        capped = torch.nan_to_num(scores / self.softcap, nan=0.0, posinf=0.0, neginf=0.0)  # masked: no gradient
        return d_scores * (1 - capped * capped)


def _blocks(
    q_starts: torch.Tensor | None, block: _Block, rank: int, offset: int, cp: int, half: int, visibility: Visibility
) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """(query part a, key part b, mask) of every pair of this rank's query chunks and the block's chunks that
    shares at least one seen (query, key)."""
    q_chunks, k_chunks = chunk_ids(rank, cp), chunk_ids((rank - offset) % cp, cp)
    for a in range(2):
        for b in range(2):
            mask = block_mask(
                visibility,
                (q_chunks[a], k_chunks[b]),
                half,
                None if q_starts is None else q_starts[:, a * half : (a + 1) * half],
                None if block.starts is None else block.starts[:, b * half : (b + 1) * half],
                block.kv.device,
            )
            if mask is not False:
                yield a, b, mask


def _sample_starts(position_ids: torch.Tensor | None, rank: int, cp: int, half: int) -> torch.Tensor | None:
    """Global index − position of each local token: equal within a packed sample (None: no positions given)."""
    if position_ids is None:
        return None
    index = torch.cat(_local_index(rank, cp, half, position_ids.device))
    return index[None, :] - position_ids.to(index.dtype)


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    visibility: Visibility,
    scoring: _Scoring,
    offsets: list[int],
    starts: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    exchange = _Exchange(group)
    rank, cp, half = exchange.rank, exchange.size, q.shape[2] // 2
    q_parts = (q[:, :, :half], q[:, :, half:])
    outs = [part.new_zeros((*part.shape[:-1], v.shape[-1]), dtype=torch.float32) for part in q_parts]  # (v's width)
    lses = [torch.full(part.shape[:-1], float("-inf"), device=q.device) for part in q_parts]
    own, width = _Block(torch.cat((k, v), dim=-1), starts), k.shape[-1]
    for offset, block in exchange.blocks(own, offsets):
        for a, b, mask in _blocks(starts, block, rank, offset, cp, half, visibility):
            cols = slice(b * half, (b + 1) * half)
            scores = scoring(q_parts[a], block.kv[:, :, cols, :width], mask)
            block_lse = torch.logsumexp(scores, dim=-1)
            weights = torch.exp(scores - block_lse[..., None])
            merged = torch.logaddexp(lses[a], block_lse)  # online softmax: rescale both parts to the new total
            keep_old, keep_new = torch.exp(lses[a] - merged), torch.exp(block_lse - merged)
            if mask is not None:  # a row that sees nothing yet (-inf − -inf): no weight, nothing kept
                weights, keep_old, keep_new = (t.nan_to_num(0.0) for t in (weights, keep_old, keep_new))
            block_out = torch.matmul(weights, block.kv[:, :, cols, width:].float())
            outs[a] = outs[a] * keep_old[..., None] + block_out * keep_new[..., None]
            lses[a] = merged
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    if sinks is not None:  # the sink's share of the softmax takes mass from every key, adds no value
        total = torch.logaddexp(lse, sinks.float()[None, :, None])
        out, lse = out * torch.exp(lse - total)[..., None], total
    return out.to(q.dtype), lse


def ring_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup,
    visibility: Visibility,
    scoring: _Scoring,
    offsets: list[int],
    starts: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    exchange = _Exchange(group)
    rank, cp, half = exchange.rank, exchange.size, q.shape[2] // 2
    grad_q = torch.zeros_like(q, dtype=torch.float32)
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # [batch, heads, local_seq]: rowsum(dO ∘ O)
    own, width = _Block(torch.cat((k, v), dim=-1), starts), k.shape[-1]
    grad_own = torch.zeros_like(own.kv, dtype=torch.float32)
    returning = None  # the previous block's gradient on its way back to its owner
    for offset, block in exchange.blocks(own, offsets):
        grad_block = torch.zeros_like(block.kv, dtype=torch.float32)
        for a, b, mask in _blocks(starts, block, rank, offset, cp, half, visibility):
            rows, cols = slice(a * half, (a + 1) * half), slice(b * half, (b + 1) * half)
            k_block, v_block = block.kv[:, :, cols, :width].float(), block.kv[:, :, cols, width:].float()
            scores = scoring(q[:, :, rows], k_block, mask)
            probs = torch.exp(scores - lse[:, :, rows, None])
            d_out = grad_out[:, :, rows].float()
            grad_block[:, :, cols, width:] += torch.matmul(probs.transpose(-2, -1), d_out)
            d_scores = probs * (torch.matmul(d_out, v_block.transpose(-2, -1)) - delta[:, :, rows, None])
            d_scores = scoring.raw_gradient(d_scores, scores) * scoring.scale
            grad_q[:, :, rows] += torch.matmul(d_scores, k_block)
            grad_block[:, :, cols, :width] += torch.matmul(d_scores.transpose(-2, -1), q[:, :, rows].float())
        if returning is not None:
            grad_own += exchange.finish(returning)[0]
            returning = None
        if offset:  # back to the rank `offset` before; this rank's own gradient comes from `offset` after
            returning = exchange.start([grad_block], -offset)
        else:
            grad_own += grad_block
    if returning is not None:
        grad_own += exchange.finish(returning)[0]
    grad_sinks = None
    if sinks is not None:  # d lse / d sink is the sink's probability; d out / d sink = −p_sink · out
        grad_sinks = -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum(dim=(0, 2)).to(sinks.dtype)
    return grad_q.to(q.dtype), grad_own[..., :width].to(k.dtype), grad_own[..., width:].to(v.dtype), grad_sinks


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, starts, group, visibility, scoring):
        offsets = visibility.offsets(dist.get_world_size(group), q.shape[2] // 2)  # (once: backward reuses them)
        out, lse = ring_forward(q, k, v, group, visibility, scoring, offsets, starts, sinks)
        ctx.save_for_backward(q, k, v, out, lse, starts, sinks)
        ctx.group, ctx.visibility, ctx.scoring, ctx.offsets = group, visibility, scoring, offsets
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, starts, sinks = ctx.saved_tensors
        grad_q, grad_k, grad_v, grad_sinks = ring_backward(
            grad_out, q, k, v, out, lse, ctx.group, ctx.visibility, ctx.scoring, ctx.offsets, starts, sinks
        )
        return grad_q, grad_k, grad_v, grad_sinks, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's two query chunks over the whole (distributed) sequence.

    `scale` multiplies the scores (default 1/sqrt(head_dim), as in scaled dot-product attention); `window` limits
    each query to the keys fewer than `window` positions back; `position_ids` [batch, local_seq] (positions
    restarting at 0 with each packed sample) keep packed samples apart; `sinks` [heads] are attention-sink logits;
    `softcap` caps the scores at ±softcap with tanh (Gemma-2).
    """
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {q.shape[2]}")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 position, got {window}")
    cp, rank, half = dist.get_world_size(group), dist.get_rank(group), q.shape[2] // 2
    starts = _sample_starts(position_ids, rank, cp, half)
    if starts is not None:
        starts = starts.expand(q.shape[0], -1).contiguous()  # a batch of 1 broadcasts over the rows
    visibility = Visibility(causal=causal, window=window)
    scoring = _Scoring(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), softcap or None)
    return RingAttention.apply(q, k, v, sinks, starts, group, visibility, scoring)
