"""The phases every profiler marks, and one training step run inside a caller's ranges.

The step (`lmsys.train.step.TrainStep`) knows nothing of who watches it. The profilers pass a
`range_fn(name) -> context manager`: NVTX ranges for nsys, record_function for torch.profiler,
allocator markers for the memory profiler. Warm-up steps run under WARMUP (or outside any capture).
"""

from __future__ import annotations

from typing import Callable, ContextManager

from lmsys.train import MODES
from lmsys.core.errors import LmsysError

FWD_STEP = "FWD_STEP"
BWD_STEP = "BWD_STEP"
OPTIM_STEP = "OPTIM_STEP"
WARMUP = "WARMUP"
STEP_RANGES = (FWD_STEP, BWD_STEP, OPTIM_STEP)

RangeFn = Callable[[str], ContextManager]


def check_mode(mode: str, allowed: tuple[str, ...] = MODES) -> str:
    if mode not in allowed:
        raise LmsysError(f"--mode must be one of {' | '.join(allowed)}, not {mode!r}")
    return mode


def run_step(step, inputs, targets, *, mode: str, range_fn: RangeFn) -> None:
    """One step of `mode` with each phase inside `range_fn(phase)`. Gradients are cleared first,
    outside the ranges (as `bench e2e` does); the loss and its graph are dropped at the end."""
    step.zero_grad()
    with range_fn(FWD_STEP):
        loss = step.forward(inputs, targets)
    if mode != "fwd":
        with range_fn(BWD_STEP):
            step.backward(loss)
    if mode == "train":
        with range_fn(OPTIM_STEP):
            step.optimizer_step()
    del loss
