"""`lmsys profile`: where time (nsys or torch.profiler) and memory go in a training step."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import (QuietOpt, DeviceOpt, DtypeOpt, FormatOpt, OutputOpt, check_counts, check_one_size,
                                    check_render_options, emit, track)
from lmsys.profiling.nsys import DEFAULT_TRACE

app = typer.Typer(help="Profiling: nsys / torch.profiler time breakdowns, memory timelines.", no_args_is_help=True)

SizeOpt = Annotated[Optional[str], typer.Option("--size", help=(
    "One preset (tiny, small, medium, large, xl, 2.7b, 10b) or a .yaml config, not a comma list: a profile "
    "looks at one configuration at a time. Default: small on a GPU, tiny on a CPU."))]
ONE_AT_A_TIME = "a profile looks at one configuration at a time"
BatchOpt = Annotated[int, typer.Option("--batch-size", "--batch", help="Sequences per step (one value: a profile looks at one configuration at a time).")]
NsysOutDirOpt = Annotated[Path, typer.Option("--out-dir", help=(
    "Where the files go: with --engine nsys the .nsys-rep, the `nsys stats` CSVs, the nsys log and the step's "
    "spec/result JSON; with --engine torch the Chrome trace (.trace.json)."))]
NsysTopOpt = Annotated[int, typer.Option("--top", help=(
    "Rows in the top-kernels tables (all measured steps, and inside --range); on a CPU, top operators."))]
MemoryOutDirOpt = Annotated[Path, typer.Option("--out-dir", help=(
    "Where the files go: the snapshot pickle and the timeline PNG (one of each per context length; "
    "with --snapshot, the PNG only)."))]
MemoryTopOpt = Annotated[int, typer.Option("--top", help="Rows in the largest-allocations table.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help=(
    "lmsys | hf:llama | hf:gpt2 | hf:qwen2 | hf:mistral | pkg.module:Name or file.py:Name (your model class or "
    "factory, built with --size's sizes by keyword); `list` lists them. Default: lmsys."))]
ModelKwargsOpt = Annotated[Optional[str], typer.Option("--model-kwargs", help=(
    "Extra keyword arguments for --model: YAML or JSON text, or a .yaml/.json file."))]


def _say(message: str) -> None:
    """A line on stderr after the tables (stdout flushed first, so the two stay in order)."""
    import sys

    sys.stdout.flush()
    typer.echo(message, err=True)


def _check_model(model: Optional[str], model_kwargs: Optional[str]) -> tuple[Optional[str], str]:
    """--model / --model-kwargs checked before torch loads (`--model list` lists and exits)."""
    from lmsys.commands.listing import list_if_asked
    from lmsys.model.user import check_model, parse_model_kwargs

    list_if_asked(model=model)
    return (check_model(model) if model else None), parse_model_kwargs(model_kwargs)


def _one_config(size: Optional[str], dev, *, context_length: int, attn_impl: Optional[str] = None,
                model: Optional[str] = None, model_kwargs: str = ""):
    from lmsys.model.config import default_size, resolve_configs

    name = size or default_size(dev.type)
    return resolve_configs([name], context_length=context_length, attn_impl=attn_impl, model=model,
                           model_kwargs=model_kwargs)[0]


def _make_out_dir(out_dir: Path) -> None:
    """Create --out-dir and probe a write there before any work: a path that cannot be a directory, a
    read-only or a full file system is one line, not a run whose files cannot be saved."""
    from lmsys.core.files import check_output_dir

    check_output_dir(out_dir, what="--out-dir")


@app.command("nsys")
def nsys(
    command: Annotated[Optional[List[str]], typer.Argument(
        help="Profile this command instead of the training step: put it after --.", show_default=False)] = None,
    size: SizeOpt = None,
    context_length: Annotated[int, typer.Option("--context-length", "--seq-len", help="Sequence length of the batch (one value: a profile looks at one configuration at a time).")] = 512,
    batch_size: BatchOpt = 4,
    dtype: DtypeOpt = "fp32",
    mode: Annotated[str, typer.Option(help="fwd | fwd-bwd | train.")] = "train",
    warmup: Annotated[int, typer.Option(help="Warm-up steps, kept out of every number.")] = 3,
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Measured steps.")] = 5,
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
    import shlex

    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.core.errors import LmsysError
    from lmsys.core.parsing import choose
    from lmsys.profiling import nsys
    from lmsys.profiling import report
    from lmsys.profiling.phases import check_mode

    model, kwargs_json = _check_model(model, model_kwargs)
    check_render_options(format, output, quiet=quiet)
    check_counts(warmup=(warmup, 0), steps=(steps, 1), batch_size=(batch_size, 1), top=(top, 1))
    check_one_size(size, command="profile nsys", why=ONE_AT_A_TIME)
    check_mode(mode)
    choose(engine, report.ENGINES, what="--engine")
    try:
        extra = shlex.split(nsys_args)
    except ValueError as exc:  # e.g. an unclosed quote
        raise LmsysError(f"--nsys-args: cannot split {nsys_args!r} ({exc})") from None
    if engine == "torch" and nsys_args:
        raise LmsysError("--nsys-args applies to --engine nsys; --engine torch runs torch.profiler")
    if annotate_attention and model not in (None, "lmsys"):
        raise LmsysError(f"--annotate-attention swaps the attention inside lmsys's model; --model {model} runs "
                         "its own")
    if command:
        return _nsys_app(list(command), engine=engine, out_dir=out_dir, trace=trace, extra=extra,
                         range_name=range_name, top=top, format=format, output=output)

    nsys_path = nsys.find_nsys() if engine == "nsys" else None
    dev = resolve_device(device)
    report.check_engine(engine, dev)
    check_dtype_for_device(dtype, dev)
    name, cfg = _one_config(size, dev, context_length=context_length,
                            attn_impl="annotated" if annotate_attention else None, model=model,
                            model_kwargs=kwargs_json)
    _make_out_dir(out_dir)
    run = dict(batch_size=batch_size, dtype=dtype, mode=mode)
    base = report.step_name(engine, name, context_length=context_length, annotated=annotate_attention, **run)
    from lmsys.core import progress

    with progress.display(f"profile nsys --engine {engine}"):
        prof = report.profile_step(engine, nsys_path, cfg, dev, warmup=warmup, steps=steps, out_dir=out_dir,
                                   name=base, trace=trace, extra=extra, **run)
    version = f"{nsys.nsys_version(nsys_path)} ({nsys_path})" if nsys_path else None
    meta = report.step_meta(environment(dev), name, cfg, warmup=warmup, steps=steps, engine=engine, nsys=version,
                            prof=prof, **run)
    shape = (batch_size, cfg.num_heads, context_length, cfg.d_head)
    emit(report.time_reports(prof, meta=meta, range_name=range_name, top=top, shape=shape), format, output)
    _say(f"nsys report: {prof.files['report']}" if engine == "nsys" else f"chrome trace: {prof.files['trace']}")


def _nsys_app(command: list[str], *, engine: str, out_dir: Path, trace: str, extra: list[str], range_name: str,
              top: int, format: str, output) -> None:
    """`profile nsys -- COMMAND`: nsys around the user's program."""
    import shlex

    from lmsys.core.errors import LmsysError
    from lmsys.profiling import nsys
    from lmsys.profiling import report

    if engine != "nsys":
        raise LmsysError("a command after -- is profiled with --engine nsys; --engine torch runs the training step")
    nsys_path = nsys.find_nsys()
    _make_out_dir(out_dir)
    prof = nsys.profile_app(nsys_path, command, out_dir=out_dir, name=report.app_name(command), trace=trace,
                            extra=extra)
    meta = {"command": shlex.join(command), "nsys": f"{nsys.nsys_version(nsys_path)} ({nsys_path})"}
    emit(report.time_reports(prof, meta=meta, range_name=range_name, top=top, shape=None), format, output)
    _say(f"nsys report: {prof.files['report']}")


@app.command("memory")
def memory(
    size: SizeOpt = None,
    context_length: Annotated[str, typer.Option("--context-length", "--seq-len", help="Sequence length, or a comma-separated list (a sweep).")] = "512",
    batch_size: BatchOpt = 4,
    dtype: DtypeOpt = "fp32",
    mode: Annotated[str, typer.Option(help="fwd | fwd-bwd | train.")] = "train",
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Recorded steps (the first one also creates the optimizer state).")] = 2,
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
    from lmsys.profiling import memory
    from lmsys.profiling.memory_analysis import analyze_snapshot, load_snapshot
    from lmsys.profiling.memory_capture import check_cuda

    model, kwargs_json = _check_model(model, model_kwargs)
    check_render_options(format, output, quiet=quiet)
    check_counts(steps=(steps, 1), batch_size=(batch_size, 1), top=(top, 1), max_entries=(max_entries, 1000))
    check_one_size(size, command="profile memory", why=ONE_AT_A_TIME)
    if snapshot is not None:
        data = load_snapshot(snapshot)
        timeline = analyze_snapshot(data, snapshot)  # a malformed file is one line, before --out-dir exists
        _make_out_dir(out_dir)
        reports, png = memory.snapshot_reports(timeline, snapshot, out_dir=out_dir, top=top)
        emit(reports, format, output)
        _say(f"timeline: {png}")
        return

    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.core.parsing import parse_int_list
    from lmsys.profiling.phases import check_mode

    check_mode(mode)
    contexts = parse_int_list(context_length, what="--context-length")
    dev = resolve_device(device)
    check_cuda(dev)
    check_dtype_for_device(dtype, dev)
    configs = [_one_config(size, dev, context_length=c, model=model, model_kwargs=kwargs_json) for c in contexts]
    _make_out_dir(out_dir)
    run = dict(batch_size=batch_size, dtype=dtype, mode=mode, steps=steps)
    sweep = memory.sweep_contexts(configs, dev, max_entries=max_entries, out_dir=out_dir, **run)
    results = list(track(sweep, total=len(configs), description="profile memory"))
    emit(memory.sweep_reports(results, environment(dev), name=configs[0][0], top=top, out_dir=out_dir, **run),
         format, output)
    for r in results:
        _say(f"snapshot: {r.pickle}  timeline: {r.png}")
