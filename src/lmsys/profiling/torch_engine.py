"""The same workload under torch.profiler: range times, top kernels (CUDA) or operators (CPU), a trace.

Each phase runs inside `record_function(FWD_STEP | BWD_STEP | OPTIM_STEP)` and synchronises before it
closes, as under nsys, so a range's duration is the phase's wall time. Warm-up steps are the profiler
schedule's warm-up: executed with the profiler on, then discarded. A kernel or operator belongs to a
range when it lies inside one of the range's instances in time, on any thread: autograd runs the
backward on its own thread, and the phases run one after another.

On CUDA, a kernel is counted where torch.profiler attaches it: to the operator that launched it (its
duration is GPU execution time). On a CPU the table lists operators by self CPU time (time in the
operator minus time in the operators it called), so nested operators are not counted twice.
"""

from __future__ import annotations

import bisect
import warnings
from contextlib import contextmanager
from pathlib import Path

from lmsys.core import progress
from lmsys.core.files import atomic_output
from lmsys.profiling.nvtx import ATTENTION_RANGES
from lmsys.profiling.phases import PROFILER_NAMES, STEP_RANGES, WARMUP
from lmsys.profiling.summary import RangeTime, Timed, TimeProfile, aggregate

RANGE_NAMES = (*STEP_RANGES, *ATTENTION_RANGES, WARMUP)


def profile_e2e(workload, device, *, mode: str, warmup: int, steps: int, out_dir: Path, name: str) -> TimeProfile:
    """Run `warmup` + `steps` steps of `mode` under torch.profiler; write NAME.trace.json."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    from lmsys.train import build_train_step, random_batch, run_step
    from lmsys.core.timing import synchronize

    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / f"{name}.trace.json"
    step = build_train_step(workload, device)
    inputs, targets = random_batch(workload, device)

    @contextmanager
    def phase(name: str):
        with record_function(name):
            yield
            synchronize(device)

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    collected: dict = {}

    def ready(prof) -> None:
        with atomic_output(trace_path, what="--out-dir") as tmp:  # an interrupt leaves no partial trace
            prof.export_chrome_trace(str(tmp))
        collected["events"] = list(prof.events())

    with warnings.catch_warnings(), without_usdt_lines():
        warnings.filterwarnings("ignore", message=".*warmup.*")  # warmup=0 is the user's choice
        with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
                     on_trace_ready=ready) as prof:
            progress.plan_steps(warmup + steps)
            for _ in range(warmup + steps):
                run_step(step, inputs, targets, mode=mode, range_fn=phase, names=PROFILER_NAMES)
                prof.step()
                progress.step()
    if "events" not in collected:  # older schedules call on_trace_ready only on exit
        ready(prof)
    del step
    profile_ = summarize_events(collected["events"], cuda=device.type == "cuda")
    profile_.files = {"trace": str(trace_path)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return profile_


@contextmanager
def without_usdt_lines():
    """Kineto (torch.profiler's C++ side) writes `USDT:... profiler_start` and `... profiler_stop` to the
    C-level stderr when a trace starts and stops. Its only switch, KINETO_LOG_LEVEL, is read once per
    process and would hide kineto's warnings and errors too (CUPTI permission errors on a GPU), so this
    sends file descriptor 2 to a temporary file while the profiler runs, then restores it and writes back
    every line that is not a `USDT:` line, in order."""
    import os
    import sys
    import tempfile

    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()  # Python's own writes in the meantime (warnings) are kept, in order
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not line.startswith(b"USDT:"))
            if kept:
                with open(2, "wb", closefd=False) as err:
                    err.write(kept)


def _is_cpu(evt) -> bool:
    return str(getattr(evt, "device_type", "")).endswith("CPU")


def _span(evt) -> tuple[float, float]:
    return evt.time_range.start, evt.time_range.end


def summarize_events(events, *, cuda: bool) -> TimeProfile:
    """torch.profiler FunctionEvents -> TimeProfile (times in ns; the profiler's are in µs)."""
    profile = TimeProfile(engine="torch", unit="kernel" if cuda else "operator")
    cpu_events = [e for e in events if _is_cpu(e)]
    instances: dict[str, list[tuple[float, float]]] = {}
    for e in cpu_events:
        if e.name in RANGE_NAMES:
            instances.setdefault(e.name, []).append(_span(e))
    windows = {name: sorted(spans) for name, spans in instances.items() if name != WARMUP}

    def inside(spans: list[tuple[float, float]], start: float, end: float) -> bool:
        i = bisect.bisect_right(spans, (start, float("inf"))) - 1  # the last window starting <= start
        return i >= 0 and spans[i][0] <= start and end <= spans[i][1]

    overall: list[Timed] = []
    per_range: dict[str, list[Timed]] = {name: [] for name in windows}
    for e in cpu_events:
        if e.name in RANGE_NAMES or e.name.startswith("ProfilerStep") or e.name == "[memory]":
            continue
        start, end = _span(e)
        if cuda:
            # (an operator's own name in its kernel list is the legacy CUDA-event timing, not a kernel)
            items = [Timed(k.name, 1, k.duration * 1e3) for k in getattr(e, "kernels", []) if k.name != e.name]
        else:
            items = [Timed(e.name, 1, e.self_cpu_time_total * 1e3)]
        if not items:
            continue
        overall += items
        for name, spans in windows.items():
            if inside(spans, start, end):
                per_range[name] += items
    profile.top = aggregate(overall)
    profile.by_range = {name: aggregate(items) for name, items in per_range.items()}
    for name, spans in windows.items():
        kernels = profile.by_range[name]
        profile.ranges.append(RangeTime(
            name, len(spans), sum(e - s for s, e in spans) * 1e3,
            device_ns=sum(k.total_ns for k in kernels) if cuda else None,
            kernels=sum(k.count for k in kernels) if cuda else None,
        ))
    return profile
