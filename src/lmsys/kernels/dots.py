"""The input precision of the Triton kernels' dots (tl.dot's input_precision) for fp32 inputs, by torch's
float32 matmul precision as torch documents the setting: "highest" splits each fp32 operand into three bf16
parts and sums six bf16 products (bf16x6: as accurate as tf32x3, whose three TF32 products it replaces, and
faster on Hopper, whose wgmma takes bf16 operands in any layout); "high" and "medium" two parts, three
products (bf16x3: about 16 mantissa bits, what torch names for "high"). tf32x3 where Triton's CUDA backend
has no bf16 splits, on GPUs without bf16 tensor cores (compute capability < 8), off a GPU and always under
Triton's interpreter (which knows only tf32, tf32x3 and ieee). The H100 measurements (error against float64,
time by config): docs/benchmarks/attention-h100-tables.md, "fp32 dots".
"""

from __future__ import annotations

import functools

import torch

from lmsys.core.devices import capability
from lmsys.kernels import triton_interpreted

INTERPRET = triton_interpreted()
FP32_DOTS = {"highest": "bf16x6", "high": "bf16x3", "medium": "bf16x3"}
FALLBACK = "tf32x3"


@functools.lru_cache(maxsize=None)
def _backend_dots() -> tuple:
    """The input precisions Triton's CUDA backend takes for tl.dot (() where they cannot be read)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        return tuple(CUDAOptions.allowed_dot_input_precisions)
    except (ImportError, AttributeError):
        return ()


def matmul_precision() -> str:
    """torch's float32 matmul precision, "highest", "high" or "medium", from either of its APIs: once the
    newer `torch.backends[.cuda.matmul].fp32_precision` was set, get_float32_matmul_precision() raises."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        setting = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
        if setting == "none":  # inherits the global one
            setting = getattr(torch.backends, "fp32_precision", "ieee")
        return {"tf32": "high", "bf16": "medium"}.get(setting, "highest")


def fp32_dots(device) -> str:
    """The input precision of fp32 dots on `device` (see the module docstring)."""
    device = torch.device(device)
    if INTERPRET or device.type != "cuda" or capability(device)[0] < 8:
        return FALLBACK
    split = FP32_DOTS.get(matmul_precision(), FP32_DOTS["highest"])
    return split if split in _backend_dots() else FALLBACK


def dot_precision(q: torch.Tensor) -> str:
    """The DOT_PRECISION constant of a kernel on inputs like q ("tf32" for 16-bit inputs: Triton ignores it)."""
    return fp32_dots(q.device) if q.dtype == torch.float32 else "tf32"
