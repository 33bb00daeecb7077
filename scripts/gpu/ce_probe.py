"""Where the copy-engine all-reduce's time goes (lmsys.distributed.copy_engine), on 2 GPUs of one host.

Rows: NCCL's all-reduce and `CopyEngineAllReduce` on one 400 MiB fp32 bucket; the latter's pieces (a
pull of the peer's copy of my 200 MiB chunk, the push it could use instead, one `handle.barrier`, the
add); the pull split into 4 or 8 copies on one stream and 2 copies on two streams; then the transfers
beside 20 bf16 matmuls (8192³) on the default stream, as in DDP's backward, with the matmul loop's time
against the loop alone. "pull → barrier" and "pull → add_" beside the matmuls start the barrier or
add a pull's time (~0.6 ms) into the loop, when the matmuls hold the SMs (with the loop's start they
would find them free).
Both ranks run every row at once (NVLink busy both ways, as in the all-reduce), started together on
the GPU per run (host barrier, then a symmetric-memory barrier on the side stream; the default stream
waits for it too). The side stream has high priority and is issued first. Each row: 5 warm-up and 20
timed runs, CUDA events, median; GB/s = algorithmic bytes (the bucket for an all-reduce, the chunk for
a copy or add) / time. Rows print as they finish; the last line names what the GPU ran for one
CopyEngineAllReduce (CUDA profiler): "Memcpy ..." means torch issued cudaMemcpyAsync, not its copy
kernel; which engine the driver then used, only the rows beside the matmuls tell.

    PYTHONPATH=src python3 scripts/gpu/ce_probe.py

Exits 2 when fewer than 2 CUDA GPUs are visible.

Prediction (H200 NV18: 450 GB/s per direction). If `copy_` from the peer runs on copy engines: alone,
pull and push ~0.55-0.8 ms each (250-380 GB/s; the pull's remote reads maybe a little slower than the
push's posted writes), a barrier ~5-20 µs, the add ~0.15-0.2 ms, so CopyEngineAllReduce ≈ 2 pulls + add
+ 3 barriers ≈ 1.3-1.8 ms against NCCL's ~1.1-1.3 ms; 4 or 8 pieces change nothing and 2 streams at most
~10 % (one memcpy already fills the links). Beside the matmuls (~32 ms alone): the pull within ~20 % of
its time alone and the matmuls within ~3 % of theirs; NCCL several times slower than alone (~5 ms, its
CTAs share the SMs) and the matmuls ~5-10 % slower. CopyEngineAllReduce's SM kernels (3 barriers, the
add) must each find room among the matmuls' blocks (priority does not preempt running blocks): "pull →
barrier" and "pull → add_" minus "pull + matmuls" is that wait. The one-GPU probe in
docs/benchmarks/ddp.md saw add_ blocks get through beside these matmuls, so I expect tens of µs each
and CopyEngineAllReduce + matmuls within ~1.3× of alone; then DDP's ~50-60 GB/s comes from elsewhere
(the backward's own kernels, e.g. persistent GEMMs that free no SM until they end, or the ranks' skew
at each bucket's first barrier). If `copy_` ran on SMs instead: similar speeds alone, but beside the
matmuls the pull several times slower (it gets only the gaps between matmul blocks) or the matmuls
clearly slower.
"""

from __future__ import annotations

import os

os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # before torch: copies only, no NVLink multicast

import datetime
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 2**20
BUCKET = 400 * MIB  # bytes of fp32 gradients per all-reduce; each rank owns half
CHUNK = BUCKET // 2
WARMUP, ITERS = 5, 20
MATMULS, N = 20, 8192


def failed(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e)[:200]}".replace("\n", " ").replace("|", "/")


def device_ops(fn) -> str:
    """The names of what the GPU ran for fn() (kernels, memcpys), per the CUDA profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return ", ".join(sorted(names)) or "nothing recorded"


def worker(rank: int, port: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # CopyEngineAllReduce checks that both ranks are on this host
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=device, timeout=datetime.timedelta(seconds=120))
    if rank == 0:
        nccl_version = torch.cuda.nccl.version()
        if isinstance(nccl_version, tuple):
            nccl_version = ".".join(map(str, nccl_version))
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {nccl_version}, GPUs: {names}\n")
        print("| row (both ranks at once) | ms (median) | GB/s | matmul loop ms | × matmuls alone |")
        print("|---|---|---|---|---|", flush=True)
    from lmsys.distributed.copy_engine import CopyEngineAllReduce

    ce, ce_failure = None, ""
    try:
        ce = CopyEngineAllReduce([BUCKET // 4], device, timeout_s=60)
        start, n = ce._chunk(0, rank)
        theirs = ce.handle.get_buffer(1 - rank, (n,), torch.float32, start)  # the peer's copy of my chunk
        mine, scratch = ce.flat[start:start + n], ce.scratch[:n]
    except Exception as e:
        ce, ce_failure = None, f"{failed(e)} (in CopyEngineAllReduce's set-up)"
    side = torch.cuda.Stream(device, priority=-1)
    other = torch.cuda.Stream(device, priority=-1)
    x = torch.zeros(BUCKET // 4, device=device)
    a, b = (torch.randn(N, N, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)

    def matmuls():
        for _ in range(MATMULS):
            torch.mm(a, b, out=c)

    def pull(pieces: int = 1):
        m = n // pieces
        for k in range(pieces):
            scratch[k * m:(k + 1) * m].copy_(theirs[k * m:(k + 1) * m])

    def pull_two_streams():
        m = n // 2
        other.wait_stream(side)
        scratch[:m].copy_(theirs[:m])
        with torch.cuda.stream(other):
            scratch[m:].copy_(theirs[m:])
        side.wait_stream(other)

    def barrier():
        ce.handle.barrier(channel=0, timeout_ms=ce.timeout_ms)

    def ce_all_reduce():
        ce.launch(0).wait()

    def bench(side_fn, main_fn):
        """Median ms of side_fn() on the side stream and of main_fn() on the default stream (None for
        the one not given), both started together on both ranks."""
        side_ms, main_ms = [], []
        for i in range(WARMUP + ITERS):
            torch.cuda.synchronize()
            dist.barrier()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            with torch.cuda.stream(side):
                if ce is not None:
                    barrier()  # the host barrier leaves the ranks some µs apart; this aligns the GPUs
                ev[0].record()
                if side_fn is not None:
                    side_fn()
                ev[1].record()
            if main_fn is not None:
                torch.cuda.current_stream().wait_event(ev[0])
                ev[2].record()
                main_fn()
                ev[3].record()
            torch.cuda.synchronize()
            if i >= WARMUP:
                side_ms.append(ev[0].elapsed_time(ev[1]))
                if main_fn is not None:
                    main_ms.append(ev[2].elapsed_time(ev[3]))
        return (statistics.median(side_ms) if side_fn is not None else None,
                statistics.median(main_ms) if main_ms else None)

    rows = [  # label, algorithmic bytes (0: no GB/s), needs the CopyEngineAllReduce, side, default stream
        ("NCCL all_reduce, 400 MiB", BUCKET, False, lambda: dist.all_reduce(x), None),
        ("CopyEngineAllReduce launch(0).wait(), 400 MiB", BUCKET, True, ce_all_reduce, None),
        ("pull: scratch.copy_(peer's buffer), 200 MiB", CHUNK, True, pull, None),
        ("push: peer's buffer.copy_(mine), 200 MiB", CHUNK, True, lambda: theirs.copy_(mine), None),
        ("handle.barrier", 0, True, barrier, None),
        ("add_: mine += scratch, 200 MiB", CHUNK, True, lambda: mine.add_(scratch), None),
        ("pull as 4 copies, one stream", CHUNK, True, lambda: pull(4), None),
        ("pull as 8 copies, one stream", CHUNK, True, lambda: pull(8), None),
        ("pull as 2 copies on 2 streams", CHUNK, True, pull_two_streams, None),
        (f"matmuls alone ({MATMULS} × bf16 {N}³)", 0, False, None, matmuls),
        ("NCCL all_reduce + matmuls", BUCKET, False, lambda: dist.all_reduce(x), matmuls),
        ("CopyEngineAllReduce + matmuls", BUCKET, True, ce_all_reduce, matmuls),
        ("pull + matmuls", CHUNK, True, pull, matmuls),
        ("pull → barrier, + matmuls", 0, True, lambda: (pull(), barrier()), matmuls),
        ("pull → add_, + matmuls", 0, True, lambda: (pull(), mine.add_(scratch)), matmuls),
    ]

    alone = None  # the matmul loop's ms without a side stream
    for label, nbytes, needs_ce, side_fn, main_fn in rows:
        if needs_ce and ce is None:
            cells = [ce_failure, "", "", ""]
        else:
            try:
                dist.barrier()
                side_t, main_t = bench(side_fn, main_fn)
                alone = main_t if side_fn is None else alone
                cells = ["—" if side_t is None else f"{side_t:.3f}",
                         f"{nbytes / side_t / 1e6:.0f}" if nbytes and side_t else "—",
                         "—" if main_t is None else f"{main_t:.2f}",
                         f"{main_t / alone:.3f}" if main_t is not None and alone else "—"]
            except Exception as e:
                cells = [failed(e), "", "", ""]
                if rank == 1:
                    print(f"rank 1: {label}: {failed(e)}", file=sys.stderr, flush=True)
        if rank == 0:
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)

    try:  # both ranks: its barriers need the peer
        ops = device_ops(ce_all_reduce) if ce is not None else ce_failure
    except Exception as e:
        ops = failed(e)
    if rank == 0:
        print(f"\none CopyEngineAllReduce, as the GPU ran it: {ops}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"ce_probe: needs 2 CUDA GPUs of one host, sees {gpus}", file=sys.stderr)
        sys.exit(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2)


if __name__ == "__main__":
    main()
