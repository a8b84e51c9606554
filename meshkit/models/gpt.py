"""Reference model: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, causal SDPA).

The repeated blocks sit in one `nn.ModuleList` named `layers`: the shape every parallelism relies on
(blocks are found, wrapped, split into pipeline stages or sharded one by one). Head counts are derived from
the weight shapes at run time, so a tensor-parallel split of the projections needs no change here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshkit.config.model import GPTConfig


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_seq_len, head_dim // 2]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the head dim. x: [batch, seq, heads, head_dim]; cos/sin: [seq, head_dim/2]."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # [batch, seq, heads, head_dim]; heads come from the weight shapes (local heads under TP)
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeats = q.shape[2] // k.shape[2]
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        # SDPA wants [batch, heads, seq, head_dim]
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over [batch, heads, seq, head_dim]; context parallel swaps this for ring attention."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer: tokens [batch, seq] -> logits [batch, seq, vocab].

    Embedding, final norm and head may be None (a pipeline stage holds only some of them); a stage without an
    embedding takes hidden states [batch, seq, dim] as input.
    """

    pipeline_first = ("tok_embeddings",)  # modules only the first pipeline stage holds
    pipeline_last = ("norm", "output")  # modules only the last pipeline stage holds
    rope_cos: torch.Tensor  # buffers
    rope_sin: torch.Tensor
    layers: nn.ModuleList

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.sequence_shards = 1  # sequence parallel sets the tp size: hidden states hold seq / tp positions
        target = torch.empty(0).device  # the caller's default device: meta inside `with torch.device("meta")`
        # Built on meta and initialised only by init_weights, so eager and meta-then-materialised models
        # draw the same random numbers and get the same weights under the same seed.
        with torch.device("meta"):
            self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
            self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every module in `named_modules` order (deterministic under torch.manual_seed)."""
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise `module`'s own parameters and buffers (not its children's).

        Meta-device materialisation calls this module by module in the same order as `init_weights`, so both
        draw the same random numbers and produce the same weights. Residual output projections get std
        0.02 / sqrt(2 * n_layers).
        """
        if module is self:
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)  # buffers are not in the state dict: recomputed after materialisation
            self.rope_sin.copy_(sin)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo", "w2")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.tok_embeddings is not None:
            seq, x = tokens.shape[1], self.tok_embeddings(tokens)
        else:  # hidden states from the previous pipeline stage; under sequence parallel a sequence shard
            seq, x = tokens.shape[1] * self.sequence_shards, tokens
        if seq > self.cfg.max_seq_len and positions is None:
            raise ValueError(f"sequence of {seq} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        index = positions if positions is not None else torch.arange(seq, device=x.device)
        cos, sin = self.rope_cos[index], self.rope_sin[index]
        for block in self.layers:
            x = block(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32. logits: [batch, seq, vocab]; targets: [batch, seq]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
