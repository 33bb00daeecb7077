"""`lmsys profile`: where time (nsys or torch.profiler) and memory go in a training step."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import (DeviceOpt, DtypeOpt, FormatOpt, OutputOpt, check_counts, check_render_options,
                                    emit, track)
from lmsys.profiling.nsys import DEFAULT_TRACE

app = typer.Typer(help="Profiling: nsys / torch.profiler time breakdowns, memory timelines.", no_args_is_help=True)

SizeOpt = Annotated[Optional[str], typer.Option(
    "--size", help="Preset (tiny, small, medium, large, xl, 2.7b, 10b) or a .yaml config. Default: small on a GPU, tiny on a CPU.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Sequences per step.")]
OutDirOpt = Annotated[Path, typer.Option("--out-dir", help="Where the report, trace, CSVs, snapshot and PNG go.")]
TopOpt = Annotated[int, typer.Option("--top", help="Rows in the top-kernels / largest-allocations tables.")]


def _say(message: str) -> None:
    """A line on stderr after the tables (stdout flushed first, so the two stay in order)."""
    import sys

    sys.stdout.flush()
    typer.echo(message, err=True)


def _one_config(size: Optional[str], dev, *, context_length: int, attn_impl: str = "naive"):
    from lmsys.bench.e2e import default_size, resolve_configs
    from lmsys.core.errors import LmsysError

    name = size or default_size(dev)
    if "," in name:
        raise LmsysError("--size takes one preset here (profile one configuration at a time)")
    return resolve_configs([name], context_length=context_length, attn_impl=attn_impl)[0]


def _make_out_dir(out_dir: Path) -> None:
    """Create --out-dir before any work, so a path that cannot be a directory is one line, not a traceback."""
    from lmsys.core.errors import LmsysError

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmsysError(f"--out-dir: cannot create {out_dir} ({exc.strerror or exc})") from None


@app.command("nsys")
def nsys(
    command: Annotated[Optional[List[str]], typer.Argument(
        help="Profile this command instead of the training step: put it after --.", show_default=False)] = None,
    size: SizeOpt = None,
    context_length: Annotated[int, typer.Option(help="Sequence length of the batch.")] = 512,
    batch_size: BatchOpt = 4,
    dtype: DtypeOpt = "fp32",
    mode: Annotated[str, typer.Option(help="fwd | fwd-bwd | train.")] = "train",
    warmup: Annotated[int, typer.Option(help="Warm-up steps, kept out of every number.")] = 3,
    steps: Annotated[int, typer.Option(help="Measured steps.")] = 5,
    device: DeviceOpt = "auto",
    engine: Annotated[str, typer.Option(help="nsys (Nsight Systems) | torch (torch.profiler; works on a CPU).")] = "nsys",
    trace: Annotated[str, typer.Option(help="nsys --trace APIs.")] = DEFAULT_TRACE,
    range_name: Annotated[str, typer.Option("--range", help="Range whose top kernels to list.")] = "FWD_STEP",
    top: TopOpt = 10,
    annotate_attention: Annotated[bool, typer.Option(
        "--annotate-attention", help="Attention with ATTN_QK_MATMUL / ATTN_SOFTMAX / ATTN_AV_MATMUL ranges.")] = False,
    nsys_args: Annotated[str, typer.Option(help="Extra `nsys profile` options, e.g. '--cuda-memory-usage=true'.")] = "",
    out_dir: OutDirOpt = Path("lmsys-out/profile"),
    format: FormatOpt = "table",
    output: OutputOpt = None,
):
    """Time per NVTX range, top kernels overall and per range, attention matmul vs softmax (nsys or torch.profiler)."""
    import shlex

    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.core.errors import LmsysError
    from lmsys.profiling import nsys as nsys_lib
    from lmsys.profiling.phases import check_mode

    check_render_options(format, output)
    check_counts(warmup=(warmup, 0), steps=(steps, 1), batch_size=(batch_size, 1), top=(top, 1))
    check_mode(mode)
    if engine not in ("nsys", "torch"):
        raise LmsysError(f"--engine must be nsys or torch, not {engine!r}")
    try:
        extra = shlex.split(nsys_args)
    except ValueError as exc:  # e.g. an unclosed quote
        raise LmsysError(f"--nsys-args: cannot split {nsys_args!r} ({exc})") from None

    if command:
        if engine != "nsys":
            raise LmsysError("a command after -- is profiled with --engine nsys; --engine torch runs the training step")
        nsys_path = nsys_lib.find_nsys()
        _make_out_dir(out_dir)
        name = "nsys_" + "".join(ch if ch.isalnum() else "_" for ch in Path(command[0]).name)
        prof = nsys_lib.profile_app(nsys_path, list(command), out_dir=out_dir, name=name, trace=trace, extra=extra)
        meta = {"command": shlex.join(command), "nsys": f"{nsys_lib.nsys_version(nsys_path)} ({nsys_path})"}
        reports = _time_reports(prof, meta=meta, range_name=range_name, top=top, shape=None)
        emit(reports, format, output)
        _say(f"nsys report: {prof.files['report']}")
        return

    nsys_path = nsys_lib.find_nsys() if engine == "nsys" else None
    dev = resolve_device(device)
    if engine == "nsys" and dev.type != "cuda":
        raise LmsysError("--engine nsys profiles CUDA kernels and needs a GPU (none in use here); use --engine torch")
    check_dtype_for_device(dtype, dev)
    name, cfg = _one_config(size, dev, context_length=context_length,
                            attn_impl="annotated" if annotate_attention else "naive")
    _make_out_dir(out_dir)
    base = f"{engine}_{Path(name).stem}_ctx{context_length}_b{batch_size}_{dtype}_{mode}"
    base += "_attn" if annotate_attention else ""
    if engine == "nsys":
        prof = nsys_lib.profile_e2e(nsys_path, config=cfg, batch_size=batch_size, dtype=dtype, mode=mode,
                                    warmup=warmup, steps=steps, device=str(dev), out_dir=out_dir, name=base,
                                    trace=trace, extra=extra)
    else:
        from lmsys.train.step import Workload
        from lmsys.profiling import torch_engine

        prof = torch_engine.profile_e2e(Workload(cfg, batch_size=batch_size, dtype=dtype), dev, mode=mode,
                                        warmup=warmup, steps=steps, out_dir=out_dir, name=base)
    from lmsys.bench.e2e import describe

    meta = environment(dev)
    meta[name] = describe(cfg)
    meta["run"] = (f"batch {batch_size}, {dtype}, mode {mode}, attention {cfg.attn_impl}, warmup {warmup} "
                   f"(not recorded), {steps} measured steps, engine {engine}")
    if engine == "nsys":
        meta["nsys"] = f"{nsys_lib.nsys_version(nsys_path)} ({nsys_path})"
    shape = (batch_size, cfg.num_heads, context_length, cfg.d_head)
    emit(_time_reports(prof, meta=meta, range_name=range_name, top=top, shape=shape), format, output)
    _say(f"nsys report: {prof.files['report']}" if engine == "nsys" else f"chrome trace: {prof.files['trace']}")


def _time_reports(prof, *, meta: dict, range_name: str, top: int, shape):
    from lmsys.core.results import Report
    from lmsys.profiling.summary import range_rows, split_rows, top_rows

    gpu = prof.unit == "kernel"
    range_notes = list(prof.notes)
    if prof.engine == "nsys":
        range_notes.append("total/avg: range duration on the host (nsys nvtx_sum); FWD/BWD/OPTIM_STEP synchronise "
                           "before closing, so theirs is the phase's wall time. GPU kernel ms: kernels executing "
                           "inside the phase's window, or for other ranges launched inside it (nvtx_kern_sum).")
    else:
        range_notes.append("total/avg: record_function duration (the phases synchronise before closing). "
                           + ("GPU kernel ms: kernels launched by operators inside the range."
                              if gpu else "On a CPU there are no kernels: the tables list PyTorch operators."))
    if not prof.ranges:
        range_notes.append("No NVTX ranges were recorded.")
    reports = [Report(f"profile {prof.engine}: time per range", range_rows(prof), meta, range_notes)]
    what = "kernels" if gpu else "operators (self CPU time)"
    reports.append(Report(f"top {top} {what}, all measured steps", top_rows(prof.top, unit=prof.unit, top=top)))
    in_range = prof.by_range.get(range_name)
    if in_range is not None:
        reports.append(Report(f"top {top} {what} in {range_name}", top_rows(in_range, unit=prof.unit, top=top),
                              notes=["%: share of the range's total."]))
    else:
        known = ", ".join(sorted(prof.by_range)) or "none"
        reports[-1].notes.append(f"No {what} recorded in range {range_name!r} (ranges with {what}: {known}).")
    split = split_rows(prof, shape=shape)
    if split:
        basis = "GPU kernel time inside each range" if gpu else "range duration on the CPU"
        notes = [f"time: {basis}. Forward only (autograd runs the backward outside these ranges)."]
        if shape is not None:
            notes.append("GFLOP: 2·B·H·S²·d per matmul (the naive math computes the full S×S scores even when "
                         "causal); softmax counted as 5 FLOPs per score (max, subtract, exp, sum, divide).")
        reports.append(Report("attention: matmul vs softmax", split, notes=notes))
    if prof.api:
        reports.append(Report("CUDA API calls (top 5)", top_rows(prof.api, unit="API call", top=5)))
    files = [f"{role}: {path}" for role, path in prof.files.items()]
    reports[-1].notes += ["Files: " + "; ".join(files)] + [f"$ {c}" for c in prof.commands]
    return reports


@app.command("memory")
def memory(
    size: SizeOpt = None,
    context_length: Annotated[str, typer.Option(help="Sequence length, or a comma-separated list (a sweep).")] = "512",
    batch_size: BatchOpt = 4,
    dtype: DtypeOpt = "fp32",
    mode: Annotated[str, typer.Option(help="fwd | fwd-bwd | train.")] = "train",
    steps: Annotated[int, typer.Option(help="Recorded steps (the first one also creates the optimizer state).")] = 2,
    device: DeviceOpt = "auto",
    top: TopOpt = 10,
    snapshot: Annotated[Optional[Path], typer.Option(
        help="Render this snapshot pickle (from a GPU run, or torch.cuda.memory._dump_snapshot) instead of running.")] = None,
    max_entries: Annotated[int, typer.Option(help="Allocator events kept in the history (older ones drop out).")] = 1_000_000,
    out_dir: OutDirOpt = Path("lmsys-out/profile"),
    format: FormatOpt = "table",
    output: OutputOpt = None,
):
    """Memory timeline PNG with phases and peak, peak per phase, largest allocations, snapshot pickle (CUDA)."""
    from lmsys.core.results import Report
    from lmsys.profiling import memory as lib

    check_render_options(format, output)
    check_counts(steps=(steps, 1), batch_size=(batch_size, 1), top=(top, 1), max_entries=(max_entries, 1000))

    if snapshot is not None:
        data = lib.load_snapshot(snapshot)
        _make_out_dir(out_dir)
        timeline = lib.analyze(data)
        png = lib.render_png(timeline, out_dir / f"{snapshot.stem}.png", title=f"{snapshot.name}: allocated memory")
        meta = {"snapshot": str(snapshot), "device": f"cuda:{timeline.device}",
                "events": f"{len(timeline.values) - 1} allocations and frees"}
        emit(_memory_reports(lib, timeline, None, meta=meta, top=top, png=png, pickle=None), format, output)
        _say(f"timeline: {png}")
        return

    from lmsys.train.step import Workload
    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.core.parsing import parse_int_list
    from lmsys.profiling.phases import check_mode

    check_mode(mode)
    contexts = parse_int_list(context_length, what="--context-length")
    dev = resolve_device(device)
    lib.check_cuda(dev)
    check_dtype_for_device(dtype, dev)
    configs = [_one_config(size, dev, context_length=c) for c in contexts]
    _make_out_dir(out_dir)

    results = []
    for name, cfg in track(configs, total=len(configs), description="profile memory"):
        cap = lib.capture(Workload(cfg, batch_size=batch_size, dtype=dtype), dev, mode=mode, steps=steps,
                          max_entries=max_entries)
        base = f"memory_{Path(name).stem}_ctx{cfg.context_length}_b{batch_size}_{dtype}_{mode}"
        pickle = lib.write_snapshot(cap.snapshot, out_dir / f"{base}.pickle")
        timeline = lib.analyze(cap.snapshot, cap.device_index)
        title = f"{name} · context {cfg.context_length} · batch {batch_size} · {dtype} · {mode}: allocated memory"
        png = lib.render_png(timeline, out_dir / f"{base}.png", title=title)
        cap.snapshot = None  # written and analysed: free it before the next context
        results.append((cfg, cap, timeline, pickle, png))

    name = configs[0][0]
    meta = environment(dev)
    meta["run"] = (f"{name}, batch {batch_size}, {dtype}, mode {mode}, {steps} recorded steps "
                   f"(model construction included)")
    if len(results) == 1:
        cfg, cap, timeline, pickle, png = results[0]
        meta["context"] = cfg.context_length
        reports = _memory_reports(lib, timeline, cap, meta=meta, top=top, png=png, pickle=pickle)
    else:
        rows = []
        for cfg, cap, timeline, pickle, png in results:
            rows.append({"context": cfg.context_length, **lib.summary_row(timeline),
                         "allocator peak MiB": cap.allocator_peak / lib.MiB,
                         "status": "OOM" if cap.oom else "ok", "timeline": png.name})
        notes = ["peak * MiB: the highest allocated memory inside that phase (max over steps), from the allocator's "
                 "history; allocator peak: torch.cuda.max_memory_allocated (rounded block sizes).",
                 f"Files in {out_dir}: " + "; ".join(f"{r[3].name}, {r[4].name}" for r in results)]
        reports = [Report("profile memory: peak per phase, by context length", rows, meta, notes)]
    emit(reports, format, output)
    for *_, pickle, png in results:
        _say(f"snapshot: {pickle}  timeline: {png}")


def _memory_reports(lib, timeline, cap, *, meta: dict, top: int, png, pickle):
    from lmsys.core.parsing import format_bytes
    from lmsys.core.results import Report

    peak_phase = timeline.phase_at(timeline.peak_index)
    where = f"{peak_phase.label}" + (f", step {peak_phase.step}" if peak_phase and peak_phase.step else "")
    notes = [f"Peak: {format_bytes(timeline.peak)} in {where}."]
    if cap is not None:
        notes.append("allocator peak: torch.cuda.max_memory_allocated over the phase (rounded block sizes; the "
                      "timeline counts requested sizes, as memory_viz does).")
        if cap.oom:
            notes.append(f"The run ran out of memory: {cap.oom}")
    elif timeline.oom:
        notes.append("The snapshot records an out-of-memory event.")
    if timeline.baseline:
        notes.append(f"{format_bytes(timeline.baseline)} was allocated before the recording began.")
    if len(timeline.phases) <= 1:
        notes.append("No phase markers in this snapshot (it was not taken by lmsys profile memory).")
    phases = Report("profile memory: peak per phase", lib.phase_rows(timeline, cap.allocator_peaks if cap else None),
                    meta, notes)
    files = [f"timeline PNG: {png}"] + ([f"snapshot (open in pytorch.org/memory_viz): {pickle}"] if pickle else [])
    largest = Report(f"largest {top} allocations (grouped by size and code location)",
                     lib.largest_rows(timeline, top), notes=files)
    return [phases, largest]
