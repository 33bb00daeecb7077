"""Record the CUDA caching allocator's history around the phases of training steps (CUDA only).

`torch.cuda.memory._record_memory_history(context="all", stacks="python")` is on from before the model is
built until the last step ends; `torch.cuda.memory._snapshot()` is pickled as is, so the file opens in
PyTorch's memory_viz (pytorch.org/memory_viz). Phase boundaries travel inside the snapshot itself: at each
boundary a function named `lmsys_phase_<PHASE>` allocates and frees a 512-byte tensor, so its allocation
carries that name in its stack frames (memory_analysis finds the boundaries there, with no side file and
no clocks). The allocator's own peak (torch.cuda.max_memory_allocated, reset at every boundary) is kept
per phase as a cross-check.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lmsys.core import progress
from lmsys.core.errors import LmsysError
from lmsys.profiling.phases import BWD_STEP, FWD_STEP, OPTIM_STEP, PROFILER_NAMES

MARK_PREFIX = "lmsys_phase_"
MARK_BYTES = 512
INIT = "init"  # from the start of recording to the first step: model, optimizer, batch
END = "END"
DEFAULT_MAX_ENTRIES = 1_000_000


def _marker(device) -> None:
    import torch

    torch.empty(MARK_BYTES, dtype=torch.uint8, device=device)  # allocated and freed at once


# The names of these functions are the markers (see the module docstring): do not rename.
def lmsys_phase_FWD_STEP(device) -> None:
    _marker(device)


def lmsys_phase_BWD_STEP(device) -> None:
    _marker(device)


def lmsys_phase_OPTIM_STEP(device) -> None:
    _marker(device)


def lmsys_phase_END(device) -> None:
    _marker(device)


_MARKERS = {FWD_STEP: lmsys_phase_FWD_STEP, BWD_STEP: lmsys_phase_BWD_STEP, OPTIM_STEP: lmsys_phase_OPTIM_STEP,
            END: lmsys_phase_END}


@dataclass
class Capture:
    snapshot: dict
    device_index: int
    allocator_peaks: dict[tuple[int, str], int] = field(default_factory=dict)  # (step, phase) -> bytes
    allocator_peak: int = 0  # torch.cuda.max_memory_allocated over the whole run
    oom: str | None = None  # the out-of-memory message, when the run hit one


def check_cuda(device) -> None:
    if device.type != "cuda":
        raise LmsysError("profile memory records the CUDA caching allocator's history and needs a CUDA GPU "
                         "(none in use here); render a snapshot taken elsewhere with --snapshot FILE.pickle")


def capture(workload, device, *, mode: str, steps: int, max_entries: int = DEFAULT_MAX_ENTRIES) -> Capture:
    """Record `steps` steps of `mode` (model construction included) and return the snapshot."""
    import torch

    from lmsys.train import build_train_step, random_batch, run_step
    from lmsys.core.devices import free_memory, is_oom

    check_cuda(device)
    record = torch.cuda.memory._record_memory_history
    index = device.index if device.index is not None else torch.cuda.current_device()
    free_memory(device)
    record(enabled=None)
    state = {"step": 0, "phase": INIT}
    peaks: dict[tuple[int, str], int] = {}
    overall = 0

    def boundary(phase: str) -> None:
        nonlocal overall
        peak = torch.cuda.max_memory_allocated(device)
        key = (state["step"], state["phase"])
        peaks[key] = max(peaks.get(key, 0), peak)
        overall = max(overall, peak)
        _MARKERS[phase](device)
        torch.cuda.reset_peak_memory_stats(device)
        state["step"] += phase == FWD_STEP
        state["phase"] = phase

    @contextmanager
    def phase_range(phase: str):
        boundary(phase)
        yield

    torch.cuda.reset_peak_memory_stats(device)
    _enable_history(record, max_entries)
    oom = None
    step = inputs = targets = None
    try:
        try:
            step = build_train_step(workload, device)
            inputs, targets = random_batch(workload, device)
            progress.plan_steps(steps, "recorded steps")
            for _ in range(steps):
                run_step(step, inputs, targets, mode=mode, range_fn=phase_range, names=PROFILER_NAMES)
                progress.step()
            boundary(END)
        except Exception as exc:  # noqa: BLE001 - an OOM is a result here; anything else is re-raised
            if not is_oom(exc):
                raise
            oom = str(exc).splitlines()[0]
            boundary(END)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        record(enabled=None)
        del step, inputs, targets
        free_memory(device)
    return Capture(snapshot, index, peaks, overall, oom)


def _enable_history(record, max_entries: int) -> None:
    try:
        record(enabled="all", context="all", stacks="python", max_entries=max_entries, clear_history=True)
    except TypeError:  # a torch without clear_history
        record(enabled="all", context="all", stacks="python", max_entries=max_entries)


def write_snapshot(snapshot: dict, path: Path) -> Path:
    """Pickle the snapshot exactly as torch.cuda.memory._dump_snapshot does (memory_viz reads it)."""
    from lmsys.core.files import atomic_output

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path, what="--out-dir") as tmp, open(tmp, "wb") as f:  # whole or not at all
        pickle.dump(snapshot, f)
    return path
