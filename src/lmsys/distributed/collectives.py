"""The all-reduce benchmark behind `lmsys comm allreduce`, run on every rank of a group (see launch.py).

Per message size: one correctness round (each rank contributes a known pattern; the result must equal
the sum over ranks, checked element by element on every rank), then `warmup` untimed rounds and `iters`
timed rounds. Each timed round is: barrier, then the all-reduce alone inside the timer's region (CUDA
events on a GPU). A round's time is the max over ranks (the collective is done when the slowest rank
is); rows report the median and mean of those maxima.

Bandwidths follow the nccl-tests convention (PERFORMANCE.md there):
    algbw = bytes / time
    busbw = algbw · 2(n−1)/n     (all-reduce moves 2(n−1)/n of the buffer through each rank's link)
so busbw is comparable across world sizes and with the link's peak.

With `baseline`, a second row per size times a bare torch.distributed loop, as one would write it by
hand: `iters` back-to-back all-reduces between two synchronisations, time / iters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lmsys.core.devices import environment, torch_dtype
from lmsys.core.timing import RegionTimer, Stats, synchronize
from lmsys.distributed.launch import RankContext, barrier

_CHUNK = 1 << 24  # elements per step when filling/checking large buffers (bounds temporary memory)
_PATTERN = 5  # rank r contributes (i mod 5) + r at index i: small integers, exact in fp16/bf16


def allreduce_job(ctx: RankContext, *, sizes: list[int], labels: list[str], dtype: str, warmup: int,
                  iters: int, baseline: bool) -> dict:
    """Rows for every size on this group (meaningful on rank 0), plus the run's environment."""
    rows = []
    for nbytes, label in zip(sizes, labels):
        rows += measure_allreduce(ctx, nbytes=nbytes, label=label, dtype=dtype, warmup=warmup, iters=iters,
                                  baseline=baseline)
    meta = environment(ctx.device)
    if ctx.backend == "nccl":
        version = torch.cuda.nccl.version()  # a tuple on recent torch, an int (e.g. 21803) on old ones
        meta["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {"rows": rows, "meta": meta}


def measure_allreduce(ctx: RankContext, *, nbytes: int, label: str, dtype: str, warmup: int, iters: int,
                      baseline: bool) -> list[dict]:
    dt = torch_dtype(dtype)
    numel = max(1, nbytes // torch.tensor([], dtype=dt).element_size())
    buf = torch.empty(numel, dtype=dt, device=ctx.device)
    nbytes = buf.numel() * buf.element_size()  # what is really sent (a multiple of the element size)
    correct = check_allreduce_sum(ctx, buf)

    buf.zero_()  # timed rounds reduce zeros: the values stay finite however many rounds run
    for _ in range(warmup):
        barrier(ctx)
        dist.all_reduce(buf)
    timer = RegionTimer(ctx.device)
    for _ in range(iters):
        barrier(ctx)
        with timer.region("allreduce"):
            dist.all_reduce(buf)
    stats = max_over_ranks(ctx, timer.samples("allreduce"))
    rows = [_row(ctx, label, nbytes, dtype, "per-round", stats.median, stats.mean, correct)]

    if baseline:
        barrier(ctx)
        synchronize(ctx.device)
        timer = RegionTimer(ctx.device)
        with timer.region("loop"):
            for _ in range(iters):
                dist.all_reduce(buf)
        per_op = max_over_ranks(ctx, timer.samples("loop")).median / iters
        rows.append(_row(ctx, label, nbytes, dtype, "bare loop", per_op, per_op, None))
    del buf
    return rows


def _row(ctx, label, nbytes, dtype, timing, median_ms, mean_ms, correct) -> dict:
    algbw = nbytes / (median_ms * 1e-3) / 1e9  # GB/s (10^9), nccl-tests convention
    n = ctx.world_size
    busbw = algbw * 2 * (n - 1) / n  # nccl-tests all-reduce bus bandwidth
    return {
        "backend": ctx.backend,
        "world size": n,
        "size": label,
        "bytes": nbytes,
        "dtype": dtype,
        "timing": timing,
        "median ms": median_ms,
        "mean ms": mean_ms,
        "algbw GB/s": algbw,
        "busbw GB/s": busbw,
        "sum correct": correct,
    }


def max_over_ranks(ctx: RankContext, samples_ms: list[float]) -> Stats:
    """Element-wise max over ranks of per-round times (every rank holds the same list afterwards)."""
    t = torch.tensor(samples_ms, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return Stats(tuple(t.tolist()))


def check_allreduce_sum(ctx: RankContext, buf: torch.Tensor) -> bool:
    """All-reduce a known pattern and check the sum on every rank; True only if every rank agrees."""
    n = ctx.world_size
    numel = buf.numel()
    for start in range(0, numel, _CHUNK):
        idx = torch.arange(start, min(numel, start + _CHUNK), device=buf.device)
        buf[start:start + idx.numel()] = (idx % _PATTERN + ctx.rank).to(buf.dtype)
    dist.all_reduce(buf)
    ok = True
    offset = n * (n - 1) // 2  # sum of the ranks
    for start in range(0, numel, _CHUNK):
        idx = torch.arange(start, min(numel, start + _CHUNK), device=buf.device)
        expected = (n * (idx % _PATTERN) + offset).to(buf.dtype)
        ok = ok and bool(torch.equal(buf[start:start + idx.numel()], expected))
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=buf.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
