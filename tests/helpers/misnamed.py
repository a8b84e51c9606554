"""A decoder whose layer names mislead: every name a name table knows points the wrong way.

Its attention's projections are named like an MLP's (q: `gate_proj`, k: `up_proj`, v: `c_fc`, output: `fc1`), its
MLP is called `self_attn` with its inputs named `o_proj`/`down_proj` and its output `q_proj`, its norms are a class
whose name says nothing (`Scale`), and its final norm is registered before the embedding. Only facts (shapes, head
counts and what each layer reads and writes in a forward) place its layers right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Scale(nn.Module):
    """An RMS norm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Mixer(nn.Module):
    """Causal self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.gate_proj, self.up_proj, self.c_fc = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.fc1 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for p in (self.gate_proj, self.up_proj, self.c_fc))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.fc1(out.transpose(1, 2).reshape(batch, seq, -1))


class Feed(nn.Module):
    """A gated MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.o_proj, self.down_proj = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.q_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(F.silu(self.o_proj(x)) * self.down_proj(x))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = Feed(dim), Mixer(dim, heads)
        self.a, self.b = Scale(dim), Scale(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(self.a(x))
        return x + self.self_attn(self.b(x))


class MisnamedDecoder(nn.Module):
    """tokens [batch, seq] -> logits; a pipeline stage holds some of embedding / final norm / head (None)."""

    pipeline_first = ("embed",)
    pipeline_last = ("final", "head")

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.final = Scale(dim)  # (registered first)
        self.embed = nn.Embedding(vocab, dim)
        self.stack = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.stack:
            x = layer(x)
        if self.final is not None:
            x = self.final(x)
        return self.head(x) if self.head is not None else x
