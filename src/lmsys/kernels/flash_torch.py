"""FlashAttention-2 in plain PyTorch: the tiled algorithm, readable, as the reference for the Triton kernels.

Algorithm (Dao, "FlashAttention-2", 2023, Algorithms 1 and 2):
- Forward: for each tile of `q_tile` queries, walk the key/value tiles of `k_tile` keys keeping a running
  row maximum m, a running denominator l and an unnormalised output (the online softmax); at the end
  O = acc / l and the logsumexp L = m + log l. Only a q_tile × k_tile block of scores exists at a time.
- Backward: recompute each block of probabilities from L, P = exp(S - L), with D = rowsum(dO ∘ O):
  dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - D), dQ += dS K / √d, dK += dSᵀ Q / √d.
- Causal (top-left aligned, as SDPA's `is_causal`): query i attends keys j <= i. Key tiles entirely above
  the diagonal are skipped; only tiles that straddle it build a mask.

Grouped-query / multi-query attention: k and v may have fewer heads (dim -3) than q, Hq a multiple of Hkv;
q is viewed as [..., Hkv, Hq/Hkv, n, d] and k, v as [..., Hkv, 1, n, d], so the products broadcast over
the group (k and v are not repeated), and dK, dV sum over it.

Limits today: arithmetic in float32 whatever the input dtype (outputs are cast back), any head dim, any
n_queries and n_keys, any leading dims. The Python tile loops make it slow on big inputs: it is for
reading, testing and small runs; `lmsys.kernels.flash_triton` is the fast one.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from lmsys.kernels.shapes import check_qkv

DEFAULT_Q_TILE = 64
DEFAULT_K_TILE = 64


def _needs_mask(q_start: int, k_end: int) -> bool:
    """A (query tile, key tile) pair straddles the diagonal when its last key is after its first query."""
    return k_end - 1 > q_start


def _causal_mask(q_start: int, q_end: int, k_start: int, k_end: int, device) -> torch.Tensor:
    rows = torch.arange(q_start, q_end, device=device)[:, None]
    cols = torch.arange(k_start, k_end, device=device)[None, :]
    return rows >= cols  # [q_tile, k_tile], True where the key is visible


def _group(q, k) -> int:
    """Query heads per key/value head (1 without grouped-query attention)."""
    return q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1


def _grouped(q, k, v, group: int):
    """q [..., Hq, n, d] -> [..., Hkv, G, n, d]; k, v [..., Hkv, n, d] -> [..., Hkv, 1, n, d] (views).
    Query head h = hkv·G + g shares key/value head hkv, as SDPA's `enable_gqa` and the Triton kernel."""
    return (rearrange(q, "... (hkv g) n d -> ... hkv g n d", g=group),
            rearrange(k, "... hkv n d -> ... hkv 1 n d"), rearrange(v, "... hkv n d -> ... hkv 1 n d"))


def flash_forward(q, k, v, is_causal: bool = False, *, q_tile: int = DEFAULT_Q_TILE,
                  k_tile: int = DEFAULT_K_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [..., n_q, d] in q's dtype, L [..., n_q] float32) by the tiled online softmax."""
    check_qkv(q, k, v, impl="flash-torch")
    group = _group(q, k)
    if group == 1:
        return _forward_tiles(q, k, v, is_causal, q_tile, k_tile)
    o, lse = _forward_tiles(*_grouped(q, k, v, group), is_causal, q_tile, k_tile)
    return rearrange(o, "... hkv g n d -> ... (hkv g) n d"), rearrange(lse, "... hkv g n -> ... (hkv g) n")


def _forward_tiles(q, k, v, is_causal: bool, q_tile: int, k_tile: int):
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for q_start in range(0, n_q, q_tile):
        q_end = min(q_start + q_tile, n_q)
        q_i = q[..., q_start:q_end, :].float()  # [..., Bq, d]
        m_i = torch.full(q_i.shape[:-1], float("-inf"), device=q.device)  # running row max
        l_i = torch.zeros(q_i.shape[:-1], device=q.device)  # running denominator
        acc = torch.zeros(q_i.shape, device=q.device)  # unnormalised output
        k_stop = min(n_k, q_end) if is_causal else n_k  # later key tiles lie above the diagonal
        for k_start in range(0, k_stop, k_tile):
            k_end = min(k_start + k_tile, n_k)
            s = (q_i @ k[..., k_start:k_end, :].float().transpose(-1, -2)) * scale  # [..., Bq, Bk]
            if is_causal and _needs_mask(q_start, k_end):
                s = s.masked_fill(~_causal_mask(q_start, q_end, k_start, k_end, q.device), float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m_i - m_new)  # rescales what was accumulated under the old maximum
            l_i = alpha * l_i + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ v[..., k_start:k_end, :].float()
            m_i = m_new
        o[..., q_start:q_end, :] = (acc / l_i[..., None]).to(q.dtype)
        lse[..., q_start:q_end] = m_i + torch.log(l_i)
    return o, lse


def flash_backward(q, k, v, o, lse, do, is_causal: bool = False, *, q_tile: int = DEFAULT_Q_TILE,
                   k_tile: int = DEFAULT_K_TILE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from P recomputed tile by tile out of L; D = rowsum(dO ∘ O). Pure tensor code, so it
    can run under torch.compile."""
    group = _group(q, k)
    if group == 1:
        return _backward_tiles(q, k, v, o, lse, do, is_causal, q_tile, k_tile)
    split = "... (hkv g) n d -> ... hkv g n d"
    dq, dk, dv = _backward_tiles(*_grouped(q, k, v, group), rearrange(o, split, g=group),
                                 rearrange(lse, "... (hkv g) n -> ... hkv g n", g=group),
                                 rearrange(do, split, g=group), is_causal, q_tile, k_tile)
    return (rearrange(dq, "... hkv g n d -> ... (hkv g) n d"),
            rearrange(dk, "... hkv 1 n d -> ... hkv n d"), rearrange(dv, "... hkv 1 n d -> ... hkv n d"))


def _backward_tiles(q, k, v, o, lse, do, is_causal: bool, q_tile: int, k_tile: int):
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    delta = (do.float() * o.float()).sum(dim=-1)  # D: [..., n_q]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for k_start in range(0, n_k, k_tile):
        k_end = min(k_start + k_tile, n_k)
        k_j = k[..., k_start:k_end, :].float()
        v_j = v[..., k_start:k_end, :].float()
        q_first = (k_start // q_tile) * q_tile if is_causal else 0  # earlier queries see none of these keys
        for q_start in range(q_first, n_q, q_tile):
            q_end = min(q_start + q_tile, n_q)
            q_i = q[..., q_start:q_end, :].float()
            do_i = do[..., q_start:q_end, :].float()
            s = (q_i @ k_j.transpose(-1, -2)) * scale  # [..., Bq, Bk]
            if is_causal and _needs_mask(q_start, k_end):
                s = s.masked_fill(~_causal_mask(q_start, q_end, k_start, k_end, q.device), float("-inf"))
            p = torch.exp(s - lse[..., q_start:q_end, None])
            dv[..., k_start:k_end, :] += _sum_to(p.transpose(-1, -2) @ do_i, dv)
            dp = do_i @ v_j.transpose(-1, -2)
            ds = p * (dp - delta[..., q_start:q_end, None])
            dq[..., q_start:q_end, :] += (ds @ k_j) * scale
            dk[..., k_start:k_end, :] += _sum_to(ds.transpose(-1, -2) @ q_i, dk) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _sum_to(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x summed over the dims where `like` has size 1 and x does not (the query heads of a group)."""
    dims = [i for i, (a, b) in enumerate(zip(x.shape, like.shape)) if b == 1 and a != 1]
    return x.sum(dims, keepdim=True) if dims else x


class FlashAttentionTorch(torch.autograd.Function):
    """`FlashAttentionTorch.apply(q, k, v, is_causal=False)`: q [..., n_q, d], k and v [..., n_k, d].

    Saves q, k, v, o and L (float32, shape q.shape[:-1]) for the backward pass, nothing else."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, q_tile=DEFAULT_Q_TILE, k_tile=DEFAULT_K_TILE):
        o, lse = flash_forward(q, k, v, bool(is_causal), q_tile=q_tile, k_tile=k_tile)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.q_tile, ctx.k_tile = bool(is_causal), q_tile, k_tile
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal, q_tile=ctx.q_tile, k_tile=ctx.k_tile)
        return dq, dk, dv, None, None, None


flash_attention = FlashAttentionTorch.apply
