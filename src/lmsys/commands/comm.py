"""`lmsys comm`: collective-communication benchmarks under torchrun."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import DeviceOpt, DtypeOpt, FormatOpt, OutputOpt, check_counts, check_render_options, emit, run_on_ranks

def check_message_sizes(labels: list[str], nbytes: list[int], dtype: str) -> None:
    """A size that is not a whole number of elements of --dtype is refused (it would be rounded)."""
    from lmsys.core.errors import LmsysError

    width = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
    for label, n in zip(labels, nbytes):
        if n % width:
            raise LmsysError(f"--sizes {label}: {n} bytes is not a whole number of {dtype} elements "
                             f"({width} bytes each)", hint=f"give a multiple of {width} bytes")


app = typer.Typer(help="Collectives: all-reduce bandwidth over gloo or NCCL.", no_args_is_help=True)


@app.command("allreduce")
def allreduce(
    backend: Annotated[Optional[str], typer.Option(help="gloo | nccl (default: nccl when a GPU is visible, else gloo).")] = None,
    world_size: Annotated[Optional[str], typer.Option(help="Process counts, comma-separated (e.g. 2,4,6); one torchrun job each. Default 2 (under torchrun: its WORLD_SIZE).")] = None,
    sizes: Annotated[str, typer.Option(help="Message sizes, comma-separated; 1MB = 10^6 bytes, 1MiB = 2^20.")] = "1MB,10MB,100MB,1GB",
    dtype: DtypeOpt = "fp32",
    warmup: Annotated[int, typer.Option(help="Untimed rounds per size.")] = 5,
    iters: Annotated[int, typer.Option("--steps", "--iters", help="Timed rounds per size.")] = 20,
    baseline: Annotated[bool, typer.Option("--baseline", metavar="", help="Also time a bare torch.distributed loop (back-to-back all-reduces) per size.")] = False,
    device: Annotated[str, typer.Option("--device", help="auto | cuda | cpu: cuda runs nccl, cpu runs gloo (auto: as --backend, else nccl when a GPU is visible).")] = "auto",
    format: FormatOpt = "table",
    output: OutputOpt = None,
):
    """All-reduce time and bandwidth (algbw, busbw) per message size and world size, with a sum check."""
    from lmsys.core.parsing import parse_bytes, parse_int_list, parse_list

    check_render_options(format, output, device=device, dtype=dtype)  # before torch is imported
    check_counts(warmup=(warmup, 0), steps=(iters, 1))
    labels = parse_list(sizes, str, what="--sizes")
    nbytes = [parse_bytes(label) for label in labels]
    check_message_sizes(labels, nbytes, dtype)
    requested = parse_int_list(world_size, what="--world-size") if world_size is not None else None

    from lmsys.core.results import Report
    from lmsys.distributed import launch

    backend = launch.backend_for_device(device, backend)
    backend = launch.resolve_backend(backend)
    world_sizes = launch.resolve_world_sizes(requested)
    launch.check_launch(backend, world_sizes)
    if warning := launch.warn_oversubscription(world_sizes, backend):
        typer.echo(warning, err=True)

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
