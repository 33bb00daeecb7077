"""The one timer every benchmark in lmsys uses, in three modes.

- Regions (`RegionTimer`, `time_fn`): on a CUDA device each region is bracketed by CUDA events recorded on
  the current stream, and the events are read once, after a single synchronisation at the end: timing does
  not serialise the host with the device between regions. Elsewhere the host clock (perf_counter) is read
  around the region. What the region measures is the wall time of the device's stream (or the host's).
- A CUDA graph (`time_graph`): `reps` calls captured in one graph and replayed inside a region, so the
  host's launch cost stays out; what is left is the device's time alone (plan calibrate's matmul rates).
- The profiler (`kernel_times`, `kernel_ms`): torch.profiler's device events (kernels and copies) summed
  per call, the gaps between them left out, whoever sets the pace (plan calibrate's block elementwise
  rate, plan breakdown's kernels by kind). On a CPU `kernel_times` reports the top-level CPU ops instead.
Warm-up steps are the caller's (or the function's `warmup`) business and are never recorded.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from lmsys.core import progress


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings, in milliseconds."""

    samples_ms: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.samples_ms)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples_ms) if self.samples_ms else math.nan

    @property
    def std(self) -> float:
        # Sample standard deviation; 0 for a single sample.
        return statistics.stdev(self.samples_ms) if self.n > 1 else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else math.nan

    @property
    def min(self) -> float:
        return min(self.samples_ms) if self.samples_ms else math.nan


def _is_cuda(device) -> bool:
    return getattr(device, "type", str(device).split(":")[0]) == "cuda"


def synchronize(device) -> None:
    """Wait for all queued work on `device` (a no-op on the CPU)."""
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize(device)


class RegionTimer:
    """Records named regions, possibly several per step: `with timer.region("forward"): ...`."""

    def __init__(self, device="cpu"):
        self.device = device
        self._cuda = _is_cuda(device)
        self._pending: dict[str, list] = defaultdict(list)  # name -> [(start_event, end_event)]
        self._host: dict[str, list[float]] = defaultdict(list)  # name -> [ms]

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        if self._cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending[name].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host[name].append((time.perf_counter() - t0) * 1e3)

    def samples(self, name: str) -> list[float]:
        """All recorded durations of `name` in ms, in order (synchronises once on CUDA)."""
        if self._pending.get(name):
            synchronize(self.device)
            self._host[name].extend(s.elapsed_time(e) for s, e in self._pending.pop(name))
        return list(self._host.get(name, []))

    def stats(self) -> dict[str, Stats]:
        names = list(dict.fromkeys([*self._host, *self._pending]))
        return {name: Stats(tuple(self.samples(name))) for name in names}


def time_fn(fn: Callable[[], object], *, warmup: int, steps: int, device="cpu") -> Stats:
    """Run `fn` `warmup` times unrecorded, then time `steps` calls one by one (plan calibrate's rates)."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    progress.plan_steps(warmup + steps)
    for _ in range(warmup):
        fn()
        progress.step()
    synchronize(device)
    timer = RegionTimer(device)
    for _ in range(steps):
        with timer.region("fn"):
            fn()
        progress.step()
    return Stats(tuple(timer.samples("fn")))


def time_graph(fn: Callable[[], object], *, warmup: int, steps: int, device="cpu", reps: int = 8) -> Stats:
    """Per-call ms of `fn` on the device alone: on a GPU `reps` calls captured in one CUDA graph, the graph
    replayed `steps` times (time_fn), each replay's time / reps; the host's launch cost (which a training
    step's queue hides where the device sets the pace) stays out. The warm-up runs on a side stream before
    the capture, so cuBLAS picks its kernels and workspace outside it. Elsewhere: `time_fn`."""
    if not _is_cuda(device):
        return time_fn(fn, warmup=warmup, steps=steps, device=device)
    import torch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    replays = time_fn(graph.replay, warmup=1, steps=steps, device=device)
    return Stats(tuple(ms / reps for ms in replays.samples_ms))


def kernel_times(fn: Callable[[], object], *, warmup: int, steps: int, device="cpu") -> dict[str, float]:
    """{name: ms per call} from torch.profiler over `steps` calls of `fn` after `warmup` unrecorded ones.
    On a GPU: the device's events (kernels, memory copies and sets; the profiler's own annotations left
    out), by kernel name; summed they are the device's busy time, gaps left out. On a CPU, where the host is
    the device: the top-level CPU ops (those no other recorded op encloses: `aten::linear`, an autograd
    node's `evaluate_function`, `Optimizer.step#AdamW.step`), each with its dispatch, so that they add up
    to the calls' time less the Python between ops."""
    import torch  # noqa: F401  (torch.profiler needs torch imported)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = _is_cuda(device)
    for _ in range(max(warmup, 1) if cuda else warmup):
        fn()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        synchronize(device)
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if cuda:
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
        elif e.device_type != DeviceType.CPU or getattr(e, "cpu_parent", None) is not None:
            continue
        out[e.name] += e.time_range.elapsed_us() / 1e3 / steps
    return dict(out)


def kernel_ms(fn: Callable[[], object], *, warmup: int, steps: int, device="cpu") -> float:
    """The device time of one call of `fn` on a GPU: its kernels' (and copies') durations summed by the
    profiler (`kernel_times`), gaps left out, whoever sets the pace (the host, for a small step); 0 where
    the profiler recorded no kernels (a run under nsys or ncu). Elsewhere, where the host is the device:
    its median time (`time_fn`)."""
    if not _is_cuda(device):
        return time_fn(fn, warmup=warmup, steps=steps, device=device).median
    return sum(kernel_times(fn, warmup=warmup, steps=steps, device=device).values())
