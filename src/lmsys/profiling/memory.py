"""What `lmsys profile memory` runs and prints: capture (memory_capture), replay (memory_analysis) and
the timeline PNG (memory_plot) of each context length, or of a snapshot taken elsewhere, as reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmsys.core.parsing import MiB, format_bytes
from lmsys.profiling.memory_analysis import Timeline, analyze, largest_rows, phase_rows, summary_row
from lmsys.profiling.memory_capture import Capture, capture, write_snapshot
from lmsys.profiling.memory_plot import render_png


@dataclass
class ContextRun:
    """One recorded context length of a sweep: its config, capture (snapshot freed), timeline and files."""

    config: object
    capture: Capture
    timeline: Timeline
    pickle: Path
    png: Path


def sweep_contexts(configs, device, *, batch_size: int, dtype: str, mode: str, steps: int, max_entries: int,
                   out_dir: Path):
    """Record each (name, config) in turn; write its snapshot pickle and PNG; yield a ContextRun."""
    from lmsys.train import Workload

    for name, cfg in configs:
        cap = capture(Workload(cfg, batch_size=batch_size, dtype=dtype), device, mode=mode, steps=steps,
                      max_entries=max_entries)
        base = f"memory_{Path(name).stem}_ctx{cfg.context_length}_b{batch_size}_{dtype}_{mode}"
        pickle_path = write_snapshot(cap.snapshot, out_dir / f"{base}.pickle")
        timeline = analyze(cap.snapshot, cap.device_index)
        title = f"{name} · context {cfg.context_length} · batch {batch_size} · {dtype} · {mode}: allocated memory"
        png = render_png(timeline, out_dir / f"{base}.png", title=title)
        cap.snapshot = None  # written and analysed: free it before the next context
        yield ContextRun(cfg, cap, timeline, pickle_path, png)


def sweep_reports(results: list[ContextRun], meta: dict, *, name: str, batch_size: int, dtype: str, mode: str,
                  steps: int, top: int, out_dir: Path) -> list:
    """One context: peak per phase and the largest allocations. Several: one row per context length."""
    from lmsys.core.results import Report

    meta["run"] = (f"{name}, batch {batch_size}, {dtype}, mode {mode}, {steps} recorded steps "
                   f"(model construction included)")
    if len(results) == 1:
        r = results[0]
        meta["context"] = r.config.context_length
        return reports(r.timeline, r.capture, meta=meta, top=top, png=r.png, pickle=r.pickle)
    rows = [{"context": r.config.context_length, **summary_row(r.timeline),
             "allocator peak MiB": r.capture.allocator_peak / MiB,
             "status": "OOM" if r.capture.oom else "ok", "timeline": r.png.name} for r in results]
    notes = ["peak * MiB: the highest allocated memory inside that phase (max over steps), from the allocator's "
             "history; allocator peak: torch.cuda.max_memory_allocated (rounded block sizes).",
             f"Files in {out_dir}: " + "; ".join(f"{r.pickle.name}, {r.png.name}" for r in results)]
    return [Report("profile memory: peak per phase, by context length", rows, meta, notes)]


def snapshot_reports(timeline: Timeline, path: Path, *, out_dir: Path, top: int) -> tuple[list, Path]:
    """Reports and timeline PNG for a snapshot pickle taken elsewhere (analysed by `analyze_snapshot`)."""
    png = render_png(timeline, out_dir / f"{path.stem}.png", title=f"{path.name}: allocated memory")
    meta = {"snapshot": str(path), "device": f"cuda:{timeline.device}",
            "events": f"{len(timeline.values) - 1} allocations and frees"}
    return reports(timeline, None, meta=meta, top=top, png=png, pickle=None), png


def reports(timeline: Timeline, cap: Capture | None, *, meta: dict, top: int, png: Path, pickle: Path | None) -> list:
    """Peak per phase (with notes on the peak, OOM and what was allocated before) and the largest allocations."""
    from lmsys.core.results import Report

    peak_phase = timeline.phase_at(timeline.peak_index)
    where_ = f"{peak_phase.label}" + (f", step {peak_phase.step}" if peak_phase and peak_phase.step else "")
    notes = [f"Peak: {format_bytes(timeline.peak)} in {where_}."]
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
    phases = Report("profile memory: peak per phase", phase_rows(timeline, cap.allocator_peaks if cap else None),
                    meta, notes)
    files = [f"timeline PNG: {png}"] + ([f"snapshot (open in pytorch.org/memory_viz): {pickle}"] if pickle else [])
    largest = Report(f"largest {top} allocations (grouped by size and code location)",
                     largest_rows(timeline, top), notes=files)
    return [phases, largest]


# ------------------------------------------------------------------------------------- the command's

def resolve(*, size: str | None, context_length: str, batch_size: int, dtype: str, mode: str, steps: int,
            device: str, top: int, snapshot: Path | None, max_entries: int, model: str | None,
            model_kwargs: str | None, out_dir: Path) -> dict:
    """Every option of `profile memory` checked, the torch-free ones first (a typo answers before torch
    loads), as `memory_reports`' arguments; --out-dir created and probed before any work (after a
    --snapshot file is read: a malformed one is one line, before --out-dir exists)."""
    from lmsys.core.files import check_output_dir
    from lmsys.core.parsing import check_counts, check_one_size
    from lmsys.model.user import check_model, parse_model_kwargs
    from lmsys.profiling.report import ONE_AT_A_TIME

    model, kwargs_json = (check_model(model) if model else None), parse_model_kwargs(model_kwargs)
    check_counts(steps=(steps, 1), batch_size=(batch_size, 1), top=(top, 1), max_entries=(max_entries, 1000))
    check_one_size(size, command="profile memory", why=ONE_AT_A_TIME)
    if snapshot is not None:
        from lmsys.profiling.memory_analysis import analyze_snapshot, load_snapshot

        timeline = analyze_snapshot(load_snapshot(snapshot), snapshot)
        check_output_dir(out_dir, what="--out-dir")
        return dict(timeline=timeline, snapshot=snapshot, out_dir=out_dir, top=top)

    from lmsys.core.devices import check_dtype_for_device, resolve_device
    from lmsys.core.parsing import parse_int_list
    from lmsys.profiling.memory_capture import check_cuda
    from lmsys.profiling.phases import check_mode
    from lmsys.profiling.report import one_config

    check_mode(mode)
    contexts = parse_int_list(context_length, what="--context-length")
    dev = resolve_device(device)
    check_cuda(dev)
    check_dtype_for_device(dtype, dev)
    configs = [one_config(size, dev, context_length=c, model=model, model_kwargs=kwargs_json) for c in contexts]
    check_output_dir(out_dir, what="--out-dir")
    return dict(configs=configs, device=dev, batch_size=batch_size, dtype=dtype, mode=mode, steps=steps,
                max_entries=max_entries, out_dir=out_dir, top=top)


def memory_reports(*, out_dir: Path, top: int, timeline: Timeline | None = None, snapshot: Path | None = None,
                   configs=None, device=None, max_entries: int = 0, **run) -> tuple[list, list[str]]:
    """`profile memory`: (its reports, the lines naming the files written): a --snapshot rendered, or each
    context length recorded (under the progress display)."""
    if snapshot is not None:
        found, png = snapshot_reports(timeline, snapshot, out_dir=out_dir, top=top)
        return found, [f"timeline: {png}"]
    from lmsys.core import progress
    from lmsys.core.devices import environment

    sweep = sweep_contexts(configs, device, max_entries=max_entries, out_dir=out_dir, **run)
    results = list(progress.rows(sweep, total=len(configs), description="profile memory"))
    found = sweep_reports(results, environment(device), name=configs[0][0], top=top, out_dir=out_dir, **run)
    return found, [f"snapshot: {r.pickle}  timeline: {r.png}" for r in results]
