"""NVTX ranges for Nsight Systems, and the attention implementation that marks its three parts.

`nvtx_range(name)` is a context manager and a decorator. It pushes an NVTX range when CUDA is available and
does nothing otherwise (torch's CPU builds have no NVTX). With `synchronize=True` it waits for the GPU
before popping, so the range's host-side duration (what `nsys stats --report nvtx_sum` reports) covers
the GPU work queued inside it, not just the launches.

`annotated_attention` is `lmsys.kernels.attention.naive_attention` (softmax(q kᵀ/√d) v, causal top-left
aligned) with its parts marked ATTN_QK_MATMUL (scores and scale), ATTN_SOFTMAX (causal mask and
softmax) and ATTN_AV_MATMUL. Each part is marked twice: an NVTX range
(seen by nsys) and a `torch.profiler.record_function` (seen by torch.profiler), so either engine sees
the split. Importing this module registers it, and the model reaches it by name:
`ModelConfig(attn_impl="annotated")`. Only the forward is marked: autograd runs the backward outside these ranges.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache

from lmsys.kernels.registry import register

ATTN_QK_MATMUL = "ATTN_QK_MATMUL"
ATTN_SOFTMAX = "ATTN_SOFTMAX"
ATTN_AV_MATMUL = "ATTN_AV_MATMUL"
ATTENTION_RANGES = (ATTN_QK_MATMUL, ATTN_SOFTMAX, ATTN_AV_MATMUL)


@lru_cache(maxsize=None)
def nvtx_available() -> bool:
    """True when NVTX calls reach a profiler: a CUDA build of torch with a visible GPU."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return torch.cuda.is_available()


class nvtx_range(contextlib.ContextDecorator):
    """`with nvtx_range("FWD_STEP"): ...` or `@nvtx_range("load")`: one NVTX push/pop (no-op without CUDA)."""

    def __init__(self, name: str, *, synchronize: bool = False):
        self.name = name
        self.synchronize = synchronize
        self._pushed = False

    def __enter__(self):
        self._pushed = nvtx_available()
        if self._pushed:
            import torch

            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc):
        if self._pushed:
            import torch

            if self.synchronize:
                torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            self._pushed = False
        return False


@contextlib.contextmanager
def mark(name: str):
    """NVTX range (for nsys) and record_function (for torch.profiler) around the same code."""
    from torch.profiler import record_function

    with nvtx_range(name), record_function(name):
        yield


PARTS = {"qk": ATTN_QK_MATMUL, "softmax": ATTN_SOFTMAX, "av": ATTN_AV_MATMUL}  # naive_attention's parts


def _mark_part(part: str):
    return mark(PARTS[part])


@register("annotated")
def annotated_attention(q, k, v, is_causal: bool = False):
    """naive_attention with its parts marked. q [..., n_q, d], k and v [..., n_k, d]."""
    from lmsys.kernels.attention import naive_attention

    return naive_attention(q, k, v, is_causal, mark=_mark_part)
