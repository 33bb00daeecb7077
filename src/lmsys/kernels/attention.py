"""One attention function for the whole project, switched by name.

`attention(q, k, v, is_causal, impl)` takes q [..., n_queries, d] and k, v [..., n_keys, d]; k and v may
have fewer heads (dim -3) than q (grouped-query attention): SDPA gets enable_gqa, the flash kernels read
the shared heads in place, and naive/compiled/annotated repeat them. Causal means
query i attends keys j <= i (top-left aligned, as SDPA's `is_causal`). Implementations:

- `naive`: softmax(q kᵀ / √d) v, the full score matrix materialised (the assignment's baseline);
- `compiled`: the naive function under torch.compile;
- `sdpa`: torch.nn.functional.scaled_dot_product_attention (PyTorch picks its backend);
- `sdpa-flash`, `sdpa-cudnn`, `sdpa-efficient`, `sdpa-math`: SDPA pinned to one backend
  (torch.nn.attention.sdpa_kernel), for benchmarks that compare against a named competitor;
- `flash-torch`, `flash-triton`: this project's FlashAttention-2 (lmsys.kernels.flash_torch/_triton).
- `annotated`: the naive math with each part in an NVTX/record_function range (lmsys.profiling.nvtx).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F

from lmsys.core.errors import LmsysError


def naive_attention(q, k, v, is_causal: bool = False):
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # [..., n_q, n_k]
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


@lru_cache(maxsize=None)
def _compiled_naive():
    return torch.compile(naive_attention)


def _compiled(q, k, v, is_causal):
    return _compiled_naive()(q, k, v, is_causal)


def _gqa(q, k) -> dict:
    """SDPA's flag for k, v with fewer heads than q (grouped-query attention), only when they have."""
    return {"enable_gqa": True} if q.dim() >= 3 and k.shape[-3] != q.shape[-3] else {}


def repeat_kv(q, k, v):
    """k, v [..., Hkv, n, d] repeated to q's Hq heads (for the implementations without grouped-query support)."""
    if q.dim() < 3 or k.shape[-3] == q.shape[-3]:
        return k, v
    return (x.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for x in (k, v))


def _sdpa(q, k, v, is_causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, **_gqa(q, k))


def _sdpa_pinned(backend_name: str) -> Callable:
    """SDPA restricted to one backend; the backward is that backend's own (chosen by the forward)."""

    def run(q, k, v, is_causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, **_gqa(q, k))

    return run


def _flash_torch(q, k, v, is_causal):
    from lmsys.kernels.flash_torch import FlashAttentionTorch

    return FlashAttentionTorch.apply(q, k, v, is_causal)


@torch.compiler.disable  # Dynamo cannot trace into triton.autotune's launcher; compiled callers graph-break here
def _flash_triton(q, k, v, is_causal):
    from lmsys.kernels.flash_triton import FlashAttentionTriton

    return FlashAttentionTriton.apply(q, k, v, is_causal)


def _annotated(q, k, v, is_causal):
    from lmsys.profiling.nvtx import annotated_attention

    return annotated_attention(q, k, v, is_causal)


IMPLS: dict[str, Callable] = {
    "naive": naive_attention,
    "compiled": _compiled,
    "sdpa": _sdpa,
    "sdpa-flash": _sdpa_pinned("FLASH_ATTENTION"),
    "sdpa-cudnn": _sdpa_pinned("CUDNN_ATTENTION"),
    "sdpa-efficient": _sdpa_pinned("EFFICIENT_ATTENTION"),
    "sdpa-math": _sdpa_pinned("MATH"),
    "flash-torch": _flash_torch,
    "flash-triton": _flash_triton,
    "annotated": _annotated,
}


def check_impl(name: str, *, d_head: int | None = None) -> str:
    """Fail before any work when `name` is unknown, or cannot run heads of size `d_head`."""
    if name not in IMPLS:
        raise LmsysError(f"unknown attention implementation {name!r}; choose from {', '.join(IMPLS)}")
    if name == "flash-triton" and d_head is not None:
        from lmsys.kernels.flash_triton import check_head_dim

        check_head_dim(d_head)
    return name


def check_qkv(q, k, v, *, impl: str) -> None:
    """Shapes every implementation needs: q [..., Hq, n_q, d], k and v [..., Hkv, n_k, d], the same leading
    dims, Hq a multiple of Hkv (grouped-query attention), one dtype and device. Raises LmsysError naming
    `impl` and the shapes."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise LmsysError(f"{impl}: q, k and v must be [..., n, d] with the same number of dims; got {shapes}")
    if k.shape != v.shape or q.shape[:-3] != k.shape[:-3] or q.shape[-1] != k.shape[-1] or (
            q.dim() == 2 and q.shape[:-2] != k.shape[:-2]):
        raise LmsysError(f"{impl}: expected q [..., n_q, d] and k, v [..., n_k, d] with the same leading dims "
                         f"and d; got {shapes}")
    if q.dim() >= 3 and q.shape[-3] % k.shape[-3]:
        raise LmsysError(f"{impl}: q has {q.shape[-3]} heads (dim -3), k and v {k.shape[-3]}: the query heads must "
                         f"be a multiple of the key/value heads ({shapes})")
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[-1] == 0:
        raise LmsysError(f"{impl}: empty sequence or head dim ({shapes})")
    if not (q.dtype == k.dtype == v.dtype):
        raise LmsysError(f"{impl}: q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise LmsysError(f"{impl}: q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")


REPEAT_KV = ("naive", "compiled", "annotated")  # the others take k, v with fewer heads than q as they are


def attention(q, k, v, is_causal: bool = False, impl: str = "naive"):
    """q [..., Hq, n_q, d], k and v [..., Hkv, n_k, d] with Hq a multiple of Hkv."""
    if impl in REPEAT_KV:
        k, v = repeat_kv(q, k, v)
    return IMPLS[check_impl(impl)](q, k, v, is_causal)
