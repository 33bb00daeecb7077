"""`lmsys comm`: collective-communication benchmarks under torchrun."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import (FormatOpt, OutputOpt, QuietOpt, check_counts, check_render_options, emit,
                                    run_on_ranks)

app = typer.Typer(help="Collectives: all-reduce, all-gather, reduce-scatter, broadcast and send-recv bandwidth over gloo or NCCL.",
                  no_args_is_help=True)

BackendOpt = Annotated[Optional[str], typer.Option(help="gloo | nccl (default: nccl when a GPU is visible, else gloo).")]
WorldSizeOpt = Annotated[Optional[str], typer.Option(help="Process counts, comma-separated (e.g. 2,4,6); one torchrun job each. Default 2 (under torchrun: its WORLD_SIZE).")]
SizesOpt = Annotated[str, typer.Option(help="Message sizes (the full buffer), comma-separated; 1MB = 10^6 bytes, 1MiB = 2^20; a whole number of --dtype elements.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="fp32 | bf16 | fp16, comma-separated: every size once per dtype (one row each).")]
WarmupOpt = Annotated[int, typer.Option(help="Untimed rounds per size.")]
StepsOpt = Annotated[int, typer.Option("--steps", "--iters", help="Timed rounds per size.")]
BareLoopOpt = Annotated[bool, typer.Option("--bare-loop", metavar="", help="Also time a bare torch.distributed loop (back-to-back collectives) per size: a `bare loop` row.")]
BaselineOpt = Annotated[bool, typer.Option("--baseline", hidden=True, help="The former name of --bare-loop.")]
CommDeviceOpt = Annotated[str, typer.Option("--device", help="auto | cuda | cpu: cuda runs nccl, cpu runs gloo (auto: as --backend, else nccl when a GPU is visible).")]
DEFAULT_SIZES = "1MB,10MB,100MB,1GB"


def measure(collective: str, *, backend, world_size, sizes, dtype, warmup, iters, baseline, device, format,
            output, quiet: bool = False) -> None:
    """Validate the shared options (before torch is imported), run `bench.comm.collective_job` per world
    size, render (rank 0)."""
    from lmsys.core.errors import LmsysError
    from lmsys.core.parsing import check_message_sizes, choose, parse_bytes, parse_int_list, parse_list

    from lmsys.core.devices import DTYPE_CHOICES

    check_render_options(format, output, device=device, quiet=quiet)
    check_counts(warmup=(warmup, 0), steps=(iters, 1))
    dtypes = [choose(d, DTYPE_CHOICES, what="--dtype") for d in parse_list(dtype, str, what="--dtype")]
    labels = parse_list(sizes, str, what="--sizes")
    nbytes = [parse_bytes(label, what="--sizes") for label in labels]
    for one in dtypes:
        check_message_sizes(labels, nbytes, one)
    requested = parse_int_list(world_size, what="--world-size") if world_size is not None else None
    if collective == "send-recv" and (odd := [n for n in requested or (2,) if n % 2]):
        raise LmsysError(f"--world-size: send-recv pairs ranks 0-1, 2-3, ..., so every world size must be even, "
                         f"got {odd[0]}")

    from lmsys.core.results import Report
    from lmsys.distributed import launch
    from lmsys.bench.comm import collective_notes

    chosen_by = launch.backend_option(device, backend)
    backend = launch.resolve_backend(launch.backend_for_device(device, backend))
    world_sizes = launch.resolve_world_sizes(requested)
    launch.check_launch(backend, world_sizes, chosen_by=chosen_by)
    if 1 in world_sizes:
        raise LmsysError("--world-size 1: a collective over one rank moves no data (busbw 0), so there is no "
                         "bandwidth to measure", hint="give 2 or more ranks")
    biggest = max(range(len(nbytes)), key=nbytes.__getitem__)  # buffers + the result check's copy: 2x
    launch.check_rank_memory(2 * nbytes[biggest], world_sizes, backend, what=f"--sizes {labels[biggest]}")
    if warning := launch.warn_oversubscription(world_sizes, backend):
        typer.echo(warning, err=True)

    rows, meta = [], {}
    for n in world_sizes:
        result = run_on_ranks("lmsys.bench.comm:collective_job",
                              dict(collective=collective, sizes=nbytes, labels=labels, dtype=dtypes, warmup=warmup,
                                   iters=iters, baseline=baseline), world_size=n, backend=backend,
                              description=f"comm {collective}")
        if result is None:  # a torchrun worker other than rank 0: rank 0 prints
            return
        rows += result["rows"]
        meta = meta or result["meta"]
    meta["run"] = (f"{backend}, {','.join(dtypes)}, warmup {warmup}, steps {iters}; per round: barrier, a one-element "
                   f"all-reduce, {collective}, max over ranks")
    title = "comm allreduce" if collective == "all-reduce" else f"comm {collective}"  # the command's name
    emit(Report(title, rows, meta, collective_notes(collective, baseline=baseline)), format, output)


def _command(collective: str, doc: str):
    """One `comm` command: the shared options, then `measure(collective, ...)`."""

    def command(backend: BackendOpt = None, world_size: WorldSizeOpt = None, sizes: SizesOpt = DEFAULT_SIZES,
                dtype: DtypeOpt = "fp32", warmup: WarmupOpt = 5, iters: StepsOpt = 20,
                bare_loop: BareLoopOpt = False, baseline: BaselineOpt = False, device: CommDeviceOpt = "auto",
                quiet: QuietOpt = False,
                format: FormatOpt = None, output: OutputOpt = None):
        measure(collective, backend=backend, world_size=world_size, sizes=sizes, dtype=dtype, warmup=warmup,
                iters=iters, baseline=bare_loop or baseline, device=device, format=format, output=output, quiet=quiet)

    command.__doc__ = doc
    command.__name__ = collective.replace("-", "_")
    return command


COMMANDS = (  # (command name, collective, help)
    ("allreduce", "all-reduce", "All-reduce time and bandwidth (algbw, busbw) per message size and world size, with a sum check."),
    ("all-gather", "all-gather", "All-gather (what FSDP and ZeRO gather parameters with): time, algbw, busbw, with a result check."),
    ("reduce-scatter", "reduce-scatter", "Reduce-scatter (FSDP's gradient reduction): time, algbw, busbw, with a sum check."),
    ("broadcast", "broadcast", "Broadcast from rank 0 (how wrappers share rank 0's weights): time, algbw, busbw, with a copy check."),
    ("send-recv", "send-recv", "Point-to-point send/recv between rank pairs 0-1, 2-3, ... both ways (what pipeline stages exchange): time, algbw, busbw, with a copy check."),
)
for _name, _collective, _doc in COMMANDS:
    app.command(_name)(_command(_collective, _doc))
app.command("all-reduce", hidden=True)(_command("all-reduce", COMMANDS[0][2]))  # the spelling of the other three
app.command("allgather", hidden=True)(_command("all-gather", COMMANDS[1][2]))  # nccl-tests' spellings
app.command("reducescatter", hidden=True)(_command("reduce-scatter", COMMANDS[2][2]))
app.command("sendrecv", hidden=True)(_command("send-recv", COMMANDS[4][2]))
