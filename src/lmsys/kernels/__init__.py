"""Attention kernels: the dispatch switch, the PyTorch tiled FlashAttention-2 and the Triton kernels."""

import os


def triton_interpreted() -> bool:
    """True when Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1). Triton reads the
    variable when a kernel is decorated, so it must be set before lmsys.kernels modules are imported."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
