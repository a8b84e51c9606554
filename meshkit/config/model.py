"""The reference model's section (`model.*`): the size of the decoder `meshkit.models.gpt.GPT` builds.

It lives with the rest of the config so that reading and validating a config never imports torch.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GPTConfig(BaseModel):
    """Size of the reference decoder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(256, ge=1, description="vocabulary size (256 = bytes)")
    dim: int = Field(128, ge=1, description="hidden size")
    n_layers: int = Field(4, ge=1, description="number of decoder blocks")
    n_heads: int = Field(4, ge=1, description="attention heads")
    n_kv_heads: int | None = Field(None, ge=1, description="key/value heads (GQA); null = n_heads")
    ffn_hidden: int | None = Field(None, ge=1, description="SwiGLU hidden size; null = about 8/3 * dim")
    max_seq_len: int = Field(512, ge=1, description="longest sequence the RoPE table covers")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon")

    @model_validator(mode="after")
    def _heads_fit(self) -> GPTConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 32 * math.ceil(8 * self.dim / 3 / 32)
