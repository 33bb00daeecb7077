"""`lmsys profile`: where time (nsys or torch.profiler) and memory go in a training step."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import check_render_options, emit
from lmsys.commands.options import (DeviceOpt, DtypeOpt, FormatOpt, ModelKwargsOpt, OutputOpt, QuietOpt, opt)
from lmsys.profiling.nsys import DEFAULT_TRACE

app = typer.Typer(help="Profiling: nsys / torch.profiler time breakdowns, memory timelines.", no_args_is_help=True)

SizeOpt = Annotated[Optional[str], opt("size", (
    "One preset (tiny, small, medium, large, xl, 2.7b, 10b) or a .yaml config, not a comma list: a profile "
    "looks at one configuration at a time. Default: small on a GPU, tiny on a CPU."))]
BatchOpt = Annotated[int, opt("batch_size", "Sequences per step (one value: a profile looks at one configuration at a time).")]
ModeOpt = Annotated[str, opt("mode", "fwd | fwd-bwd | train.")]
NsysOutDirOpt = Annotated[Path, opt("out_dir", (
    "Where the files go: with --engine nsys the .nsys-rep, the `nsys stats` CSVs, the nsys log and the step's "
    "spec/result JSON; with --engine torch the Chrome trace (.trace.json)."))]
NsysTopOpt = Annotated[int, opt("top", (
    "Rows in the top-kernels tables (all measured steps, and inside --range); on a CPU, top operators."))]
MemoryOutDirOpt = Annotated[Path, opt("out_dir", (
    "Where the files go: the snapshot pickle and the timeline PNG (one of each per context length; "
    "with --snapshot, the PNG only)."))]
MemoryTopOpt = Annotated[int, opt("top", "Rows in the largest-allocations table.")]
ModelOpt = Annotated[Optional[str], opt("model", (
    "lmsys | hf:llama | hf:gpt2 | hf:qwen2 | hf:mistral | pkg.module:Name or file.py:Name (your model class or "
    "factory, built with --size's sizes by keyword); `list` lists them. Default: lmsys."))]


def _say(lines: list[str]) -> None:
    """Lines on stderr after the tables (stdout flushed first, so the two stay in order)."""
    import sys

    sys.stdout.flush()
    for line in lines:
        typer.echo(line, err=True)


@app.command("nsys")
def nsys(
    command: Annotated[Optional[List[str]], typer.Argument(
        help="Profile this command instead of the training step: put it after --.", show_default=False)] = None,
    size: SizeOpt = None,
    context_length: Annotated[int, opt("context_length", "Sequence length of the batch (one value: a profile looks at one configuration at a time).")] = 512,
    batch_size: BatchOpt = 4,
    dtype: DtypeOpt = "fp32",
    mode: ModeOpt = "train",
    warmup: Annotated[int, opt("warmup", "Warm-up steps, kept out of every number.")] = 3,
    steps: Annotated[int, opt("steps", "Measured steps.")] = 5,
    device: DeviceOpt = "auto",
    engine: Annotated[str, typer.Option(help="nsys (Nsight Systems) | torch (torch.profiler; works on a CPU).")] = "nsys",
    trace: Annotated[str, typer.Option(help="nsys --trace APIs.")] = DEFAULT_TRACE,
    range_name: Annotated[str, typer.Option("--range", help="Range whose top kernels to list.")] = "FWD_STEP",
    top: NsysTopOpt = 10,
    annotate_attention: Annotated[bool, typer.Option(
        "--annotate-attention", metavar="", help="Attention with ATTN_QK_MATMUL / ATTN_SOFTMAX / ATTN_AV_MATMUL ranges.")] = False,
    model: ModelOpt = None,
    model_kwargs: ModelKwargsOpt = None,
    nsys_args: Annotated[str, typer.Option(help="Extra `nsys profile` options, e.g. '--cuda-memory-usage=true'.")] = "",
    out_dir: NsysOutDirOpt = Path("lmsys-out/profile"),
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Time per NVTX range, top kernels overall and per range, attention matmul vs softmax (nsys or torch.profiler)."""
    from lmsys.commands.listing import list_if_asked
    from lmsys.profiling import report

    list_if_asked(model=model)
    check_render_options(format, output, quiet=quiet)
    resolved = report.resolve(
        command=command, size=size, context_length=context_length, batch_size=batch_size, dtype=dtype, mode=mode,
        warmup=warmup, steps=steps, device=device, engine=engine, trace=trace, range_name=range_name, top=top,
        annotate_attention=annotate_attention, model=model, model_kwargs=model_kwargs, nsys_args=nsys_args,
        out_dir=out_dir)
    reports, where = report.nsys_reports(**resolved)
    emit(reports, format, output)
    _say([where])


@app.command("memory")
def memory(
    size: SizeOpt = None,
    context_length: Annotated[str, opt("context_length", "Sequence length, or a comma-separated list (a sweep).")] = "512",
    batch_size: BatchOpt = 4,
    dtype: DtypeOpt = "fp32",
    mode: ModeOpt = "train",
    steps: Annotated[int, opt("steps", "Recorded steps (the first one also creates the optimizer state).")] = 2,
    device: DeviceOpt = "auto",
    top: MemoryTopOpt = 10,
    snapshot: Annotated[Optional[Path], typer.Option(
        help="Render this snapshot pickle (from a GPU run, or torch.cuda.memory._dump_snapshot) instead of running.")] = None,
    max_entries: Annotated[int, typer.Option(help="Allocator events kept in the history (older ones drop out).")] = 1_000_000,
    model: ModelOpt = None,
    model_kwargs: ModelKwargsOpt = None,
    out_dir: MemoryOutDirOpt = Path("lmsys-out/profile"),
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Memory timeline PNG with phases and peak, peak per phase, largest allocations, snapshot pickle (CUDA)."""
    from lmsys.commands.listing import list_if_asked
    from lmsys.profiling import memory

    list_if_asked(model=model)
    check_render_options(format, output, quiet=quiet)
    resolved = memory.resolve(size=size, context_length=context_length, batch_size=batch_size, dtype=dtype, mode=mode,
                              steps=steps, device=device, top=top, snapshot=snapshot, max_entries=max_entries,
                              model=model, model_kwargs=model_kwargs, out_dir=out_dir)
    reports, files = memory.memory_reports(**resolved)
    emit(reports, format, output)
    _say(files)
