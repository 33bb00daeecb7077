"""`lmsys comm`: collective-communication benchmarks under torchrun."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import check_render_options, emit, run_on_ranks
from lmsys.commands.options import FormatOpt, OutputOpt, QuietOpt, opt

app = typer.Typer(help="Collectives: all-reduce, all-gather, reduce-scatter, broadcast and send-recv bandwidth over gloo or NCCL.",
                  no_args_is_help=True)

BackendOpt = Annotated[Optional[str], opt("backend", "gloo | nccl (default: nccl when a GPU is visible, else gloo).")]
WorldSizeOpt = Annotated[Optional[str], opt("world_size", "Process counts, comma-separated (e.g. 2,4,6); one torchrun job each. Default 2 (under torchrun: its WORLD_SIZE).")]
SizesOpt = Annotated[str, typer.Option("--sizes", help="Message sizes (the full buffer), comma-separated; 1MB = 10^6 bytes, 1MiB = 2^20; a whole number of --dtype elements.")]
DtypeOpt = Annotated[str, opt("dtype", "fp32 | bf16 | fp16, comma-separated: every size once per dtype (one row each).")]
WarmupOpt = Annotated[int, opt("warmup", "Untimed rounds per size.")]
StepsOpt = Annotated[int, opt("steps", "Timed rounds per size.")]
BareLoopOpt = Annotated[bool, typer.Option("--bare-loop", metavar="", help="Also time a bare torch.distributed loop (back-to-back collectives) per size: a `bare loop` row.")]
BaselineOpt = Annotated[bool, opt("baseline", "The former name of --bare-loop.", hidden=True, metavar=None)]
CommDeviceOpt = Annotated[str, opt("device", "auto | cuda | cpu: cuda runs nccl, cpu runs gloo (auto: as --backend, else nccl when a GPU is visible).")]
DEFAULT_SIZES = "1MB,10MB,100MB,1GB"


def measure(collective: str, *, backend, world_size, sizes, dtype, warmup, iters, baseline, device, format,
            output, quiet: bool = False) -> None:
    """Check the options (before torch is imported: lmsys.bench.comm_runs.resolve), run
    `bench.comm.collective_job` per world size, render (rank 0)."""
    from lmsys.bench import comm_runs

    check_render_options(format, output, device=device, quiet=quiet)
    run = comm_runs.resolve(collective, backend=backend, world_size=world_size, sizes=sizes, dtype=dtype,
                            warmup=warmup, iters=iters, baseline=baseline, device=device)
    if run.warning:
        typer.echo(run.warning, err=True)
    results = []
    for n in run.world_sizes:
        result = run_on_ranks("lmsys.bench.comm:collective_job", run.job, world_size=n, backend=run.backend,
                              description=f"comm {collective}")
        if result is None:  # a torchrun worker other than rank 0: rank 0 prints
            return
        results.append(result)
    emit(comm_runs.comm_report(run, results), format, output)


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
