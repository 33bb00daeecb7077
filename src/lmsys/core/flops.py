"""The one FLOP counter: model training FLOPs for MFU, and attention FLOPs for kernel benchmarks.

Conventions (say them wherever a rate is printed):
- Model: 6·N·tokens for forward+backward (2·N forward), N = parameters that take part in a matmul
  (all but the token-embedding table, which is a lookup), plus attention's score and value matmuls,
  4·S·d_model per token per layer forward, counted in full even when causal (the PaLM convention:
  12·L·H·Q·T per token for forward+backward).
- Attention kernels: 4·b·h·n_q·n_k·d forward (two matmuls), backward 2.5× forward (five matmuls of
  which one recomputes P), both halved when causal (only the lower triangle is computed).
"""

from __future__ import annotations


MFU_NOTE = "MFU: 6·N·tokens + attention (PaLM convention, causal counted in full) over the peak for the dtype"
ATTENTION_RATE_NOTE = ("TFLOP/s: 4·b·h·s²·d forward, 2.5× that backward, halved when causal, over the mean time.")


def model_flops_per_token(*, d_model: int, d_ff: int, num_layers: int, vocab_size: int,
                          seq_len: int, backward: bool, kv_dim: int | None = None) -> float:
    """kv_dim: the width of the key and of the value projection (d_model, or fewer with grouped-query
    attention: key/value heads × head dim)."""
    kv_dim = d_model if kv_dim is None else kv_dim
    attn_params = 2 * d_model * d_model + 2 * d_model * kv_dim  # q and output; k and v
    matmul_params = num_layers * (attn_params + 3 * d_model * d_ff) + d_model * vocab_size
    attn = 4 * seq_len * d_model * num_layers  # QKᵀ and PV, forward, per token
    forward = 2 * matmul_params + attn
    return 3 * forward if backward else forward


def model_flops(config, *, batch_size: int, seq_len: int, backward: bool) -> float:
    """FLOPs of one step of `config` over batch_size × seq_len tokens (forward only or fwd+bwd)."""
    per_token = model_flops_per_token(
        d_model=config.d_model, d_ff=config.d_ff, num_layers=config.num_layers,
        vocab_size=config.vocab_size, seq_len=seq_len, backward=backward,
        kv_dim=getattr(config, "kv_heads", config.num_heads) * config.d_head,
    )
    return per_token * batch_size * seq_len


def module_matmul_params(model) -> int:
    """Weights one token multiplies by in `model` (a torch module, duck-typed): every module's own 2-D
    `weight` (Linear, GPT-2's Conv1D, a hand-written Linear), counted once per module that uses it (a
    tied LM head counts), embedding tables (a lookup: class name ending in Embedding) not."""
    total = 0
    for module in model.modules():
        weight = getattr(module, "_parameters", {}).get("weight")
        if weight is not None and weight.dim() == 2 and not type(module).__name__.endswith("Embedding"):
            total += weight.numel()
    return total


def attention_flops(*, batch: int, heads: int, n_queries: int, n_keys: int, d_head: int,
                    causal: bool, direction: str) -> float:
    """direction: 'fwd', 'bwd' or 'fwd+bwd'."""
    fwd = 4.0 * batch * heads * n_queries * n_keys * d_head
    if causal:
        fwd /= 2
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[direction]


def mfu(flops: float, ms: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's peak, or None without a peak."""
    if peak_tflops is None or not ms or ms != ms:
        return None
    return flops / (ms * 1e-3) / (peak_tflops * 1e12)
