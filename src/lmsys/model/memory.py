"""Will a training step fit, checked before anything is built: RAM available now, and the estimate.

The estimate is the planner's memory model (`lmsys.plan.memory.memory`, the one lmsys has; held within
2 % of measured peaks on an H200 and against torch's profiler on a CPU) for one process: the config's
shape, its attention kind, no recomputation, fp32 weights under autocast for 16-bit dtypes (as bench e2e
runs), the step's peak phase. `bench e2e` on a CPU checks it against the RAM available
(`check_fits_in_ram`), `ddp train` against free GPU memory before its one-process rows
(lmsys.distributed.memory). Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lmsys.core.errors import LmsysError
from lmsys.model.config import ModelConfig


def train_memory_estimate(config: ModelConfig, *, batch_size: int, context_length: Optional[int] = None,
                          dtype: str = "fp32", device: str = "cuda") -> int:
    """Bytes one process needs at the peak of a training step of `config` on `batch_size` sequences: the
    planner's memory model (lmsys.plan.memory; `device` "cuda" or "cpu": CUDA's fp32 softmax under
    autocast and cuBLAS's workspaces, or not)."""
    from lmsys.plan import memory as mem
    from lmsys.plan.shape import from_model_config

    if context_length is not None:
        config = config.with_overrides(context_length=context_length)
    shape = from_model_config(config, name="model")
    prec = mem.precision(dtype, master_weights=False)
    return int(mem.memory(shape, mem.Layout(micro_batch=batch_size), prec, capacity=float("inf"), device=device).total)


def available_ram() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes, else the free pages sysconf reports (None if neither)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits_in_ram(config: ModelConfig, *, batch_size: int, dtype: str = "fp32", what: str = "the model",
                      available: Optional[int] = None) -> None:
    """A user error, before the model is built, when the estimate exceeds the RAM available now."""
    available = available_ram() if available is None else available
    if available is None:
        return
    need = train_memory_estimate(config, batch_size=batch_size, dtype=dtype, device="cpu")
    if need > available:
        from lmsys.core.parsing import about_bytes, format_bytes

        raise LmsysError(f"{what}: a training step (weights, gradients, AdamW state, activations) needs "
                         f"{about_bytes(need)}, but {format_bytes(available)} of RAM is available",
                         hint="use a smaller --size, --batch-size or --context-length, or a GPU")
