"""`lmsys comm`: collective-communication benchmarks under torchrun."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import DtypeOpt, FormatOpt, OutputOpt, check_counts, check_render_options, emit, run_on_ranks

app = typer.Typer(help="Collectives: all-reduce bandwidth over gloo or NCCL.", no_args_is_help=True)


@app.command("allreduce")
def allreduce(
    backend: Annotated[Optional[str], typer.Option(help="gloo | nccl (default: nccl when a GPU is visible, else gloo).")] = None,
    world_size: Annotated[Optional[str], typer.Option(help="Process counts, comma-separated (e.g. 2,4,6); one torchrun job each. Default 2 (under torchrun: its WORLD_SIZE).")] = None,
    sizes: Annotated[str, typer.Option(help="Message sizes, comma-separated; 1MB = 10^6 bytes, 1MiB = 2^20.")] = "1MB,10MB,100MB,1GB",
    dtype: DtypeOpt = "fp32",
    warmup: Annotated[int, typer.Option(help="Untimed rounds per size.")] = 5,
    iters: Annotated[int, typer.Option(help="Timed rounds per size.")] = 20,
    baseline: Annotated[bool, typer.Option("--baseline", help="Also time a bare torch.distributed loop (back-to-back all-reduces) per size.")] = False,
    format: FormatOpt = "table",
    output: OutputOpt = None,
):
    """All-reduce time and bandwidth (algbw, busbw) per message size and world size, with a sum check."""
    from lmsys.core.devices import torch_dtype
    from lmsys.core.parsing import parse_bytes, parse_int_list, parse_list
    from lmsys.core.results import Report
    from lmsys.distributed import launch

    check_render_options(format, output)
    check_counts(warmup=(warmup, 0), iters=(iters, 1))
    labels = parse_list(sizes, str, what="--sizes")
    nbytes = [parse_bytes(label) for label in labels]
    torch_dtype(dtype)
    backend = launch.resolve_backend(backend)
    requested = parse_int_list(world_size, what="--world-size") if world_size is not None else None
    world_sizes = launch.resolve_world_sizes(requested)
    launch.check_launch(backend, world_sizes)

    rows, meta = [], {}
    for n in world_sizes:
        result = run_on_ranks("lmsys.distributed.collectives:allreduce_job",
                              dict(sizes=nbytes, labels=labels, dtype=dtype, warmup=warmup, iters=iters,
                                   baseline=baseline), world_size=n, backend=backend)
        if result is None:  # a torchrun worker other than rank 0: rank 0 prints
            return
        rows += result["rows"]
        meta = meta or result["meta"]
    meta["run"] = (f"{backend}, {dtype}, warmup {warmup}, iters {iters}; per round: barrier, all-reduce, "
                   "max over ranks")
    notes = ["algbw = bytes / median time; busbw = algbw · 2(n−1)/n (nccl-tests convention). "
             "GB/s = 10^9 bytes/s."]
    if baseline:
        notes.append("bare loop: iters back-to-back all-reduces between two synchronisations, time / iters.")
    emit(Report("comm allreduce", rows, meta, notes), format, output)
