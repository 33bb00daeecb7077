"""The one timer every benchmark in lmsys uses.

On a CUDA device each region is bracketed by CUDA events recorded on the current stream, and the events
are read once, after a single synchronisation at the end: timing does not serialise the host with the
device between regions. Elsewhere the host clock (perf_counter) is read around the region. Warm-up steps
are the caller's (or `time_fn`'s) business and are never recorded.
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
