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
