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
- `annotated`: the naive math with each part in an NVTX/record_function range, registered by
  lmsys.profiling.nvtx when it is imported (kernels import nothing above them; see registry.py).
- a user's (`yours-torch`, `pkg.module:Name`, ...), once `registry.resolve` has loaded it: it gets
  [batch, seq, d] (leading dims flattened, shared heads repeated).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F

from lmsys.core.parsing import choose
from lmsys.kernels.registry import ATTENTION, IMPLS, USER, spec, three_d


def _scaled_scores(q, k):
    return (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # [..., n_q, n_k]


def _causal_masked(scores, is_causal: bool):
    """Scores with the keys each query may not see at -inf: query i sees keys j <= i (top-left aligned)."""
    if not is_causal:
        return scores
    keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~keep, float("-inf"))


def _unmarked(part: str):
    return nullcontext()


def naive_attention(q, k, v, is_causal: bool = False, *, mark: Callable | None = None):
    """softmax(q kᵀ / √d) v with the whole score matrix. `mark(part)`, when given, is a context manager
    around each part ("qk": scores and scale, "softmax": causal mask and softmax, "av": the product with v);
    lmsys.profiling.nvtx's annotated attention passes NVTX ranges."""
    mark = mark or _unmarked
    with mark("qk"):
        scores = _scaled_scores(q, k)
    with mark("softmax"):
        probs = torch.softmax(_causal_masked(scores, is_causal), dim=-1).to(v.dtype)
    with mark("av"):
        return probs @ v


def reference_attention(q, k, v, is_causal: bool = False, device="cpu"):
    """(o, L) in float64 on `device` (the CPU unless asked: a GPU for long sequences): naive_attention's
    math, with L the logsumexp of each row of scores. k and v with fewer heads than q (dim -3) are
    repeated to q's heads. Differentiable: autograd reaches the inputs through the copies."""
    q, k, v = (x.to(device, torch.float64) for x in (q, k, v))
    k, v = repeat_kv(q, k, v)
    scores = _causal_masked(_scaled_scores(q, k), is_causal)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


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


def _flash_triton(q, k, v, is_causal):
    from lmsys.kernels.flash import flash_attention  # custom ops under torch.compile: no graph break

    return flash_attention(q, k, v, is_causal)


IMPLS.update({
    "naive": naive_attention,
    "compiled": _compiled,
    "sdpa": _sdpa,
    "sdpa-flash": _sdpa_pinned("FLASH_ATTENTION"),
    "sdpa-cudnn": _sdpa_pinned("CUDNN_ATTENTION"),
    "sdpa-efficient": _sdpa_pinned("EFFICIENT_ATTENTION"),
    "sdpa-math": _sdpa_pinned("MATH"),
    "flash-torch": _flash_torch,
    "flash-triton": _flash_triton,
})


def check_impl(name: str, *, d_head: int | None = None) -> str:
    """Fail before any work when `name` is unknown, or cannot run heads of size `d_head`."""
    if name not in IMPLS:  # a name of lmsys's whose module is not imported yet, or a user's import path
        from lmsys.kernels.registry import resolve

        resolve(name, adapters=None)
    choose(name, IMPLS, what="attention implementation")
    if d_head is not None:
        spec(name).check_head_dim(d_head)
    return name


# lmsys's that repeat k, v to q's heads (AttentionSpec.grouped_query False); the others take them as they are
# (a user's [batch, seq, d] function gets them repeated by three_d). A tuple: the hot path tests it per call.
REPEAT_KV = ATTENTION.names(lambda s: not s.grouped_query and not s.user)


def attention(q, k, v, is_causal: bool = False, impl: str = "naive"):
    """q [..., Hq, n_q, d], k and v [..., Hkv, n_k, d] with Hq a multiple of Hkv."""
    if impl in REPEAT_KV:
        k, v = repeat_kv(q, k, v)
    fn = IMPLS[check_impl(impl)]
    if impl in USER:
        return three_d(fn, q, k, v, is_causal)
    return fn(q, k, v, is_causal)
