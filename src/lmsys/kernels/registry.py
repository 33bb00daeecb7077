"""Attention implementations by name (torch-free, so layers above kernels can register at import time).

`lmsys.kernels.attention` fills in its own implementations; a layer above adds its own without kernels
importing it: `lmsys.profiling.nvtx` registers `annotated`. `lmsys.kernels.attention.IMPLS` is this dict.
"""

from __future__ import annotations

from typing import Callable

IMPLS: dict[str, Callable] = {}


def register(name: str, fn: Callable | None = None):
    """`register(name, fn)`, or `@register(name)` on fn(q, k, v, is_causal) -> out. Returns fn."""
    if fn is None:
        return lambda f: register(name, f)
    IMPLS[name] = fn
    return fn
