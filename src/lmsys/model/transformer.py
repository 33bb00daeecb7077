"""A pre-norm decoder-only Transformer LM, written out: RMSNorm, RoPE, causal MHA, SwiGLU.

Modules read top-down: LM -> block -> attention -> MLP -> norm -> linear/embedding; RoPE is a free
function at the end. Attention itself goes through `lmsys.kernels.attention.attention`, switched by
`ModelConfig.attn_impl`. The model knows nothing of parallelism or profiling.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmsys.kernels.attention import attention
from lmsys.model.config import ModelConfig


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.token_embeddings = Embedding(config.vocab_size, config.d_model, **kw)
        self.layers = nn.ModuleList(TransformerBlock(config, **kw) for _ in range(config.num_layers))
        self.ln_final = RMSNorm(config.d_model, **kw)
        self.lm_head = Linear(config.d_model, config.vocab_size, **kw)
        cos, sin = rope_tables(config.context_length, config.d_head, config.rope_theta, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [S_max, d_head/2]
        self.register_buffer("rope_sin", sin, persistent=False)

    def hidden_states(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, S] -> final-norm hidden states [B, S, D] (the LM head's input)."""
        seq_len = token_ids.shape[-1]
        if seq_len > self.config.context_length:
            raise ValueError(f"sequence length {seq_len} > context_length {self.config.context_length}")
        x = self.token_embeddings(token_ids)
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.ln_final(x)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, S] -> logits [B, S, V]."""
        return self.lm_head(self.hidden_states(token_ids))


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, **kw):
        super().__init__()
        self.ln1 = RMSNorm(config.d_model, **kw)
        self.attn = CausalSelfAttention(config, **kw)
        self.ln2 = RMSNorm(config.d_model, **kw)
        self.ffn = SwiGLU(config.d_model, config.d_ff, **kw)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.ffn(self.ln2(x))


class CausalSelfAttention(nn.Module):
    """project (x -> q, k, v) -> attend (RoPE, causal attention over the heads) -> project_out.

    The tensor-parallel (lmsys.distributed.model_parallel.tensor_parallel.TPAttention) and torch-DTensor
    (model_parallel.torch_parallel.TorchAttention) versions override the projections only: `attend` is
    every version's, on whatever heads its projection gives it."""

    def __init__(self, config: ModelConfig, **kw):
        super().__init__()
        self.num_heads, self.kv_heads, self.d_head = config.num_heads, config.kv_heads, config.d_head
        self.attn_impl = config.attn_impl
        # q, k, v fused: one matmul; k and v have kv_heads heads (fewer than q with grouped-query attention)
        self.qkv_proj = Linear(config.d_model, (config.num_heads + 2 * config.kv_heads) * config.d_head, **kw)
        self.output_proj = Linear(config.d_model, config.d_model, **kw)

    def forward(self, x, cos, sin):
        return self.project_out(self.attend(*self.project(x), cos, sin))

    def project(self, x):
        """x [B, S, D] -> q [B, H, S, d_head], k and v [B, Hkv, S, d_head]."""
        heads = rearrange(self.qkv_proj(x), "b s (h d) -> b h s d", d=self.d_head)  # H + 2·Hkv heads
        return heads.split([self.num_heads, self.kv_heads, self.kv_heads], dim=1)

    def attend(self, q, k, v, cos, sin):
        """RoPE on q and k, causal attention (`attn_impl`) -> [B, S, H·d_head]."""
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, is_causal=True, impl=self.attn_impl)  # [B, H, S, d_head]
        return rearrange(out, "b h s d -> b s (h d)")

    def project_out(self, out):
        """[B, S, H·d_head] -> [B, S, D]."""
        return self.output_proj(out)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int, **kw):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, **kw)
        self.w3 = Linear(d_model, d_ff, **kw)
        self.w2 = Linear(d_ff, d_model, **kw)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 and cast back."""

    def __init__(self, d_model: int, eps: float = 1e-5, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x):
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(in_dtype)


class Linear(nn.Module):
    """y = x Wᵀ, no bias; W ~ truncated normal with variance 2 / (d_in + d_out), cut at ±3σ."""

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (in_features + out_features))
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x):
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    """Row lookup in a [vocab, d_model] table initialised from a truncated standard normal."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids):
        return self.weight[token_ids]


# ------------------------------------------------------------------------------------------------ RoPE


def rope_tables(max_len: int, d_head: int, theta: float, *, device=None):
    """cos/sin of position·θ^(-2i/d) for i < d/2: two [max_len, d_head/2] float32 tables.

    Angles are computed in float64 so that long contexts keep exact relative positions."""
    inv_freq = theta ** (-torch.arange(0, d_head, 2, device=device, dtype=torch.float64) / d_head)
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) by the position's angle. x: [..., S, d_head]; cos, sin: [S, d/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
