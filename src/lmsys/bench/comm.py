"""The collective benchmarks behind `lmsys comm all-reduce|all-gather|reduce-scatter|broadcast|send-recv`, run
on every rank of a group (lmsys.distributed.launch); the flat calls themselves are lmsys.distributed.primitives.

One function measures every collective (`collective_job`, parameterised by its name). Per message size:
one correctness round (each rank contributes a known pattern; the result must be what the collective
produces, checked element by element on every rank), then `warmup` untimed rounds and `iters` timed
rounds. Each timed round is: barrier, a one-element all-reduce that lines the devices up (the host
skew between ranks stays out of the timing), then the collective alone inside the timer's region
(CUDA events on a GPU). A round's time is the max over ranks (the collective is done when the
slowest rank is); rows report the median and mean of those maxima.

The size of a row is the full buffer, as in nccl-tests: the gathered output of an all-gather, the
input of a reduce-scatter (both rounded down to a multiple of the world size, each rank's part
bytes / n), the one buffer of an all-reduce or broadcast, what each rank sends (and receives) in a
send-recv. send-recv pairs ranks 0↔1, 2↔3, ... (an even world size), each pair sending both ways at once. Bandwidths follow nccl-tests (PERFORMANCE.md):
algbw = bytes / time, busbw = algbw · BUS_FACTORS[collective] (lmsys.core.collectives: the one table) (the fraction of the buffer that crosses
each rank's link), so busbw compares across collectives and world sizes and with the link's peak.

With `baseline`, a second row per size times a bare torch.distributed loop, as one would write it by
hand: `iters` back-to-back collectives between two synchronisations, time / iters.

Where the backend lacks the single-tensor call (gloo on older torch has no reduce_scatter_tensor or
all_gather_into_tensor), the fallback runs and the row's `op` column names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from lmsys.core import progress
from lmsys.core.collectives import BUS_FACTORS, bus_factor  # noqa: F401  (importable from here too)
from lmsys.core.devices import environment, torch_dtype
from lmsys.core.errors import LmsysError
from lmsys.core.timing import RegionTimer, Stats, synchronize
from lmsys.distributed.launch import RankContext, barrier
from lmsys.distributed.primitives import ALL_GATHER_OP, REDUCE_SCATTER_OP, all_gather_flat, reduce_scatter_flat

BROADCAST_SRC = 0
_CHUNK = 1 << 24  # elements per step when filling/checking large buffers (bounds temporary memory)
_PATTERN = 5  # rank r contributes (i mod 5) + r at index i: small integers, exact in fp16/bf16


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "broadcast")
POINT_TO_POINT = ("send-recv",)


def collective_notes(collective: str, *, baseline: bool) -> list[str]:
    """The notes under a `comm` table: the bandwidth convention of `collective`, what `correct` and `op` mean."""
    notes = [f"algbw = bytes / median time; busbw = algbw · {BUS_FACTORS[collective][0]} (nccl-tests convention for "
             f"{collective}). GB/s = 10^9 bytes/s."]
    if collective in ("all-gather", "reduce-scatter"):
        notes.append("bytes: the full buffer (all ranks' parts together), rounded down to a multiple of the "
                     "world size; each rank sends or receives bytes / n of it.")
    if collective == "broadcast":
        notes.append(f"broadcast from rank {BROADCAST_SRC}.")
    if collective == "send-recv":
        notes.append("bytes: what each rank sends to its peer (and receives from it) per round; ranks paired "
                     "0↔1, 2↔3, ..., both directions at once (nccl-tests sendrecv_perf).")
    notes.append("correct: every rank's result equals what the collective must produce from known inputs. "
                 "op: the torch.distributed call that ran (a fallback where the backend lacks the preferred one).")
    if baseline:
        notes.append(f"bare loop: steps back-to-back {collective}s between two synchronisations, time / steps.")
    return notes


# ------------------------------------------------------------------------------------------ benchmark


@dataclass
class Buffers:
    """What one collective reads and writes; `inp is out` for all-reduce and broadcast (in place); `peer`:
    the rank a send-recv exchanges with."""

    collective: str
    inp: torch.Tensor
    out: torch.Tensor
    world_size: int
    peer: int | None = None

    @property
    def chunk(self) -> int:  # each rank's part of the full buffer
        return self.full_numel // self.world_size

    @property
    def full_numel(self) -> int:
        return self.inp.numel() if self.collective == "reduce-scatter" else self.out.numel()


def send_recv_peer(rank: int) -> int:
    """The rank `rank` exchanges with in a send-recv: 0↔1, 2↔3, ..."""
    return rank ^ 1


def make_buffers(collective: str, *, numel: int, world_size: int, dtype: torch.dtype, device,
                 rank: int = 0) -> Buffers:
    """Buffers whose full size is `numel` elements (a multiple of world_size for all-gather and
    reduce-scatter; for send-recv, what `rank` sends)."""
    full = torch.empty(numel, dtype=dtype, device=device)
    if collective == "send-recv":
        return Buffers(collective, full, torch.empty_like(full), world_size, peer=send_recv_peer(rank))
    if collective == "all-gather":
        return Buffers(collective, torch.empty(numel // world_size, dtype=dtype, device=device), full, world_size)
    if collective == "reduce-scatter":
        return Buffers(collective, full, torch.empty(numel // world_size, dtype=dtype, device=device), world_size)
    return Buffers(collective, full, full, world_size)


def _list_all_gather(b: Buffers):
    return dist.all_gather(list(b.out.chunk(b.world_size)), b.inp)


def _all_reduce_then_copy(b: Buffers):
    dist.all_reduce(b.inp)
    rank = dist.get_rank()
    b.out.copy_(b.inp[rank * b.chunk:(rank + 1) * b.chunk])


def _batch_send_recv(b: Buffers):
    ops = [dist.P2POp(dist.isend, b.inp, b.peer), dist.P2POp(dist.irecv, b.out, b.peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _isend_irecv(b: Buffers):
    for work in (dist.isend(b.inp, b.peer), dist.irecv(b.out, b.peer)):
        work.wait()


# op name (the `op` column) -> how it runs; per collective, the preferred op first, then fallbacks
OPS: dict[str, Callable[[Buffers], object]] = {
    "all_reduce": lambda b: dist.all_reduce(b.out),
    ALL_GATHER_OP: lambda b: all_gather_flat(b.out, b.inp),
    "all_gather (list)": _list_all_gather,
    REDUCE_SCATTER_OP: lambda b: reduce_scatter_flat(b.out, b.inp),
    "all_reduce + copy (no reduce_scatter)": _all_reduce_then_copy,
    "broadcast": lambda b: dist.broadcast(b.out, src=BROADCAST_SRC),
    "batch_isend_irecv": _batch_send_recv,
    "isend + irecv": _isend_irecv,
}
CANDIDATES = {
    "all-reduce": ("all_reduce",),
    "all-gather": (ALL_GATHER_OP, "all_gather (list)"),
    "reduce-scatter": (REDUCE_SCATTER_OP, "all_reduce + copy (no reduce_scatter)"),
    "broadcast": ("broadcast",),
    "send-recv": ("batch_isend_irecv", "isend + irecv"),
}


def _unsupported(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, NotImplementedError) or "support" in text or "not implemented" in text


def collective_job(ctx: RankContext, *, collective: str, sizes: list[int], labels: list[str], dtype: str | list[str],
                   warmup: int, iters: int, baseline: bool) -> dict:
    """Rows for every dtype (one, or a list: --dtype's sweep) and size on this group (meaningful on rank 0),
    plus the run's environment."""
    if collective == "send-recv" and ctx.world_size % 2:
        raise LmsysError(f"send-recv pairs ranks 0-1, 2-3, ...: the world size must be even, got {ctx.world_size}")
    dtypes = [dtype] if isinstance(dtype, str) else list(dtype)
    rows = []
    progress.plan_rows(len(sizes) * len(dtypes))
    for dt in dtypes:
        for nbytes, label in zip(sizes, labels):
            progress.start_row(f"{collective} {label}" + (f" {dt}" if len(dtypes) > 1 else ""))
            rows += measure_collective(ctx, collective, nbytes=nbytes, label=label, dtype=dt, warmup=warmup,
                                       iters=iters, baseline=baseline)
    meta = environment(ctx.device)
    if ctx.backend == "nccl":
        version = torch.cuda.nccl.version()  # a tuple on recent torch, an int (e.g. 21803) on old ones
        meta["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {"rows": rows, "meta": meta}


def measure_collective(ctx: RankContext, collective: str, *, nbytes: int, label: str, dtype: str, warmup: int,
                       iters: int, baseline: bool) -> list[dict]:
    dt = torch_dtype(dtype)
    n = ctx.world_size
    numel = max(1, nbytes // torch.tensor([], dtype=dt).element_size())
    if collective in ("all-gather", "reduce-scatter"):
        numel = max(n, numel // n * n)  # each rank's part is numel / n
    bufs = make_buffers(collective, numel=numel, world_size=n, dtype=dt, device=ctx.device, rank=ctx.rank)
    nbytes = numel * bufs.out.element_size()  # what is really measured (the full buffer; send-recv: one send)

    op_name, correct = None, None
    for name in CANDIDATES[collective]:  # the first op this backend runs
        try:
            correct = check_result(ctx, bufs, run=lambda: OPS[name](bufs))
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            if not _unsupported(exc):
                raise
            continue
        op_name = name
        break
    if op_name is None:
        del bufs
        return [_row(ctx, collective, label, nbytes, dtype, "per-round", None, None, None, "unsupported")]
    op = OPS[op_name]

    bufs.inp.zero_()  # timed rounds move zeros: the values stay finite however many rounds run
    progress.plan_steps(warmup + iters, "rounds")
    for _ in range(warmup):
        barrier(ctx)
        op(bufs)
        progress.step()
    timer = RegionTimer(ctx.device)
    flag = torch.zeros(1, dtype=torch.float32, device=ctx.device)
    for _ in range(iters):
        barrier(ctx)
        # A one-element all-reduce queued right before the start event: the GPUs leave it together, so
        # the timed region does not include the host-side skew between ranks' launches (on 2xH200 that
        # skew was ~0.1 ms a round: 0.94x the bare loop for a 1 GB all-gather).
        dist.all_reduce(flag)
        with timer.region("op"):
            op(bufs)
        progress.step()
    stats = max_over_ranks(ctx, timer.samples("op"))
    rows = [_row(ctx, collective, label, nbytes, dtype, "per-round", stats.median, stats.mean, correct, op_name)]

    if baseline:
        barrier(ctx)
        synchronize(ctx.device)
        timer = RegionTimer(ctx.device)
        with timer.region("loop"):
            for _ in range(iters):
                op(bufs)
        per_op = max_over_ranks(ctx, timer.samples("loop")).median / iters
        rows.append(_row(ctx, collective, label, nbytes, dtype, "bare loop", per_op, per_op, None, op_name))
    del bufs
    return rows


def _row(ctx, collective, label, nbytes, dtype, timing, median_ms, mean_ms, correct, op_name) -> dict:
    n = ctx.world_size
    algbw = busbw = None
    if median_ms is not None:
        algbw = nbytes / (median_ms * 1e-3) / 1e9  # GB/s (10^9), nccl-tests convention
        busbw = algbw * bus_factor(collective, n)  # nccl-tests bus bandwidth of this collective
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
        "correct": correct,
        "op": op_name,
    }


def max_over_ranks(ctx: RankContext, samples_ms: list[float]) -> Stats:
    """Element-wise max over ranks of per-round times (every rank holds the same list afterwards)."""
    t = torch.tensor(samples_ms, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return Stats(tuple(t.tolist()))


# --------------------------------------------------------------------------------------- correctness


def _spans(b: Buffers, rank: int) -> tuple[int, int]:
    """Global index of the first element of this rank's input and of its output."""
    in_start = rank * b.chunk if b.collective == "all-gather" else 0
    out_start = rank * b.chunk if b.collective == "reduce-scatter" else 0
    return in_start, out_start


def _expected(b: Buffers, idx: torch.Tensor) -> torch.Tensor:
    """What the collective must leave at global indices idx, when rank r put (i mod 5) + r at index i."""
    n = b.world_size
    if b.collective in ("all-reduce", "reduce-scatter"):  # sum over ranks
        return n * (idx % _PATTERN) + n * (n - 1) // 2
    if b.collective == "all-gather":  # index i comes from rank i // chunk
        return idx % _PATTERN + idx // b.chunk
    if b.collective == "send-recv":  # the peer's input
        return idx % _PATTERN + b.peer
    return idx % _PATTERN + BROADCAST_SRC  # broadcast: the source's values everywhere


def check_result(ctx: RankContext, bufs: Buffers, *, run: Callable[[], object]) -> bool:
    """Fill a known pattern, `run()` the collective, check the output on every rank; True only if every
    rank saw exactly what the collective must produce."""
    in_start, out_start = _spans(bufs, ctx.rank)
    for start in range(0, bufs.inp.numel(), _CHUNK):
        idx = torch.arange(start, min(bufs.inp.numel(), start + _CHUNK), device=bufs.inp.device) + in_start
        bufs.inp[start:start + idx.numel()] = (idx % _PATTERN + ctx.rank).to(bufs.inp.dtype)
    if bufs.out is not bufs.inp:
        bufs.out.fill_(-1)  # nothing left over from before counts as a result
    run()
    ok = True
    for start in range(0, bufs.out.numel(), _CHUNK):
        idx = torch.arange(start, min(bufs.out.numel(), start + _CHUNK), device=bufs.out.device) + out_start
        expected = _expected(bufs, idx).to(bufs.out.dtype)
        ok = ok and bool(torch.equal(bufs.out[start:start + idx.numel()], expected))
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=bufs.out.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
