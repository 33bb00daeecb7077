"""The phases every profiler marks.

The step runner (`lmsys.train.run_step`) knows nothing of who watches it. The profilers pass a
`range_fn(name) -> context manager` (NVTX ranges for nsys, record_function for torch.profiler,
allocator markers for the memory profiler) and PROFILER_NAMES, which names the three phases and puts no
range around the whole step. Warm-up steps run under WARMUP (or outside any capture).
"""

from __future__ import annotations

from lmsys.train import MODES
from lmsys.core.parsing import choose

FWD_STEP = "FWD_STEP"
BWD_STEP = "BWD_STEP"
OPTIM_STEP = "OPTIM_STEP"
WARMUP = "WARMUP"
STEP_RANGES = (FWD_STEP, BWD_STEP, OPTIM_STEP)
PROFILER_NAMES = {"forward": FWD_STEP, "backward": BWD_STEP, "optimizer": OPTIM_STEP}


def check_mode(mode: str, allowed: tuple[str, ...] = MODES) -> str:
    return choose(mode, allowed, what="--mode")
