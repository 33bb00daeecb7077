"""Cross-entropy of the LM head without materialising the [tokens, vocab] logits.

`chunked_cross_entropy(hidden, weight, targets)` = mean over tokens of logsumexp(h Wᵀ) - (h Wᵀ)[target],
computed over chunks of tokens: forward keeps only the logsumexp per token (fp32); backward recomputes
each chunk's logits and turns them into dlogits = (softmax - onehot) / T on the spot. Peak extra memory is
one chunk of logits instead of the whole [T, V] matrix in fp32 plus its gradient (for batch 4 × 16k tokens
and a 10k vocabulary: ~64 MiB instead of ~5 GiB). The price is the LM-head matmul done once more in backward.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 256 * 2**20  # fp32 logits per chunk


def _compute_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


def _accumulation_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows: int, compute_dtype: torch.dtype):
        # hidden [T, D], weight [V, D], targets [T]
        T = hidden.shape[0]
        acc = _accumulation_dtype(compute_dtype)
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
        lse = torch.empty(T, device=hidden.device, dtype=acc)
        total = torch.zeros((), device=hidden.device, dtype=acc)
        for s in range(0, T, chunk_rows):
            logits = (h[s:s + chunk_rows] @ w.T).to(acc)  # [c, V]
            lse_c = torch.logsumexp(logits, dim=-1)
            lse[s:s + chunk_rows] = lse_c
            total += (lse_c - logits.gather(1, targets[s:s + chunk_rows, None]).squeeze(1)).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_rows, ctx.compute_dtype = chunk_rows, compute_dtype
        return total / T

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        T, c = hidden.shape[0], ctx.chunk_rows
        acc = lse.dtype
        h, w = hidden.to(ctx.compute_dtype), weight.to(ctx.compute_dtype)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc)
        scale = grad_loss.to(acc) / T
        for s in range(0, T, c):
            h_c = h[s:s + c]
            p = torch.exp((h_c @ w.T).to(acc) - lse[s:s + c, None])  # softmax, [c, V]
            p.scatter_add_(1, targets[s:s + c, None], torch.full_like(p[:, :1], -1.0))  # - onehot
            dlogits = (p * scale).to(ctx.compute_dtype)
            grad_h[s:s + c] = (dlogits @ w).to(hidden.dtype)
            grad_w += (dlogits.T @ h_c).to(acc)
        return grad_h, grad_w.to(weight.dtype), None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          *, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Mean cross-entropy of logits = hidden @ weightᵀ. hidden [..., D], weight [V, D], targets [...]."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    chunk_rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    dtype = _compute_dtype(hidden.device.type, torch.promote_types(hidden.dtype, weight.dtype))
    with torch.autocast(hidden.device.type, enabled=False):
        return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_rows, dtype)
