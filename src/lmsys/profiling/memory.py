"""Where memory goes in a training step: the CUDA allocator's history, recorded and rendered offline.

Capture (CUDA only): `torch.cuda.memory._record_memory_history(context="all", stacks="python")` is on
from before the model is built until the last step ends; `torch.cuda.memory._snapshot()` is pickled as
is, so the file opens in PyTorch's memory_viz (pytorch.org/memory_viz).

Phase boundaries travel inside the snapshot itself: at each boundary a function named
`lmsys_phase_<PHASE>` allocates and frees a 512-byte tensor. Its allocation carries that function in its
stack frames, so the renderer finds the boundaries in any snapshot taken this way, with no side file and
no reliance on clocks. The markers are left out of every number.

Rendering (anywhere, no GPU needed): the allocated-bytes timeline is replayed from the trace (alloc +
size, free − size, in order; sizes as requested, as memory_viz shows them), shifted by what was
already allocated when recording began (what the final state holds that the trace does not explain).
From it: a PNG with the phases shaded and the peak marked, peak memory per phase, and the largest
allocations with the Python frames that made them. Live runs also read the allocator's own peak
(torch.cuda.max_memory_allocated, reset at every boundary) per phase, as a cross-check: it counts
rounded block sizes, so it is a little larger.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lmsys.core.errors import LmsysError
from lmsys.core.parsing import MiB, format_bytes
from lmsys.profiling.phases import BWD_STEP, FWD_STEP, OPTIM_STEP, PROFILER_NAMES

MARK_PREFIX = "lmsys_phase_"
MARK_BYTES = 512
INIT = "init"  # from the start of recording to the first step: model, optimizer, batch
END = "END"
DEFAULT_MAX_ENTRIES = 1_000_000
PHASE_LABELS = {INIT: "init", FWD_STEP: "forward", BWD_STEP: "backward", OPTIM_STEP: "optimizer", END: "after"}


# ------------------------------------------------------------------------------------------ capture


def _marker(device) -> None:
    import torch

    torch.empty(MARK_BYTES, dtype=torch.uint8, device=device)  # allocated and freed at once


# The names of these functions are the markers (see the module docstring): do not rename.
def lmsys_phase_FWD_STEP(device) -> None:
    _marker(device)


def lmsys_phase_BWD_STEP(device) -> None:
    _marker(device)


def lmsys_phase_OPTIM_STEP(device) -> None:
    _marker(device)


def lmsys_phase_END(device) -> None:
    _marker(device)


_MARKERS = {FWD_STEP: lmsys_phase_FWD_STEP, BWD_STEP: lmsys_phase_BWD_STEP, OPTIM_STEP: lmsys_phase_OPTIM_STEP,
            END: lmsys_phase_END}


@dataclass
class Capture:
    snapshot: dict
    device_index: int
    allocator_peaks: dict[tuple[int, str], int] = field(default_factory=dict)  # (step, phase) -> bytes
    allocator_peak: int = 0  # torch.cuda.max_memory_allocated over the whole run
    oom: str | None = None  # the out-of-memory message, when the run hit one


def check_cuda(device) -> None:
    if device.type != "cuda":
        raise LmsysError("profile memory records the CUDA caching allocator's history and needs a CUDA GPU "
                         "(none in use here); render a snapshot taken elsewhere with --snapshot FILE.pickle")


def capture(workload, device, *, mode: str, steps: int, max_entries: int = DEFAULT_MAX_ENTRIES) -> Capture:
    """Record `steps` steps of `mode` (model construction included) and return the snapshot."""
    import torch

    from lmsys.train import build_train_step, random_batch, run_step
    from lmsys.core.devices import free_memory, is_oom

    check_cuda(device)
    record = torch.cuda.memory._record_memory_history
    index = device.index if device.index is not None else torch.cuda.current_device()
    free_memory(device)
    record(enabled=None)
    state = {"step": 0, "phase": INIT}
    peaks: dict[tuple[int, str], int] = {}
    overall = 0

    def boundary(phase: str) -> None:
        nonlocal overall
        peak = torch.cuda.max_memory_allocated(device)
        key = (state["step"], state["phase"])
        peaks[key] = max(peaks.get(key, 0), peak)
        overall = max(overall, peak)
        _MARKERS[phase](device)
        torch.cuda.reset_peak_memory_stats(device)
        state["step"] += phase == FWD_STEP
        state["phase"] = phase

    @contextmanager
    def phase_range(phase: str):
        boundary(phase)
        yield

    torch.cuda.reset_peak_memory_stats(device)
    _enable_history(record, max_entries)
    oom = None
    step = inputs = targets = None
    try:
        try:
            step = build_train_step(workload, device)
            inputs, targets = random_batch(workload, device)
            for _ in range(steps):
                run_step(step, inputs, targets, mode=mode, range_fn=phase_range, names=PROFILER_NAMES)
            boundary(END)
        except Exception as exc:  # noqa: BLE001 - an OOM is a result here; anything else is re-raised
            if not is_oom(exc):
                raise
            oom = str(exc).splitlines()[0]
            boundary(END)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        record(enabled=None)
        del step, inputs, targets
        free_memory(device)
    return Capture(snapshot, index, peaks, overall, oom)


def _enable_history(record, max_entries: int) -> None:
    try:
        record(enabled="all", context="all", stacks="python", max_entries=max_entries, clear_history=True)
    except TypeError:  # a torch without clear_history
        record(enabled="all", context="all", stacks="python", max_entries=max_entries)


def write_snapshot(snapshot: dict, path: Path) -> Path:
    """Pickle the snapshot exactly as torch.cuda.memory._dump_snapshot does (memory_viz reads it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return path


class _PlainUnpickler(pickle.Unpickler):
    """Snapshots hold only dicts, lists, strings and numbers: refuse anything that would run code."""

    def find_class(self, module, name):
        raise LmsysError(f"not a plain memory snapshot: it references {module}.{name}; refusing to load it")


def load_snapshot(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise LmsysError(f"--snapshot: {path} is a directory; give the snapshot .pickle file")
    if not path.is_file():
        raise LmsysError(f"--snapshot: {path} does not exist")
    try:
        with open(path, "rb") as f:
            data = _PlainUnpickler(f).load()
    except LmsysError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise LmsysError(f"--snapshot: {path} is not a pickled memory snapshot ({type(exc).__name__})") from None
    if not isinstance(data, dict) or "device_traces" not in data:
        raise LmsysError(f"--snapshot: {path} has no 'device_traces': not a torch.cuda.memory._snapshot() pickle")
    return data


# ---------------------------------------------------------------------------------------- analysis


@dataclass
class Phase:
    step: int
    name: str  # INIT, FWD_STEP, BWD_STEP, OPTIM_STEP or END
    start: int  # index into Timeline.values of the first value in the phase
    end: int  # one past the last
    start_bytes: int
    peak_bytes: int
    peak_index: int
    end_bytes: int

    @property
    def label(self) -> str:
        return PHASE_LABELS.get(self.name, self.name)


@dataclass
class Allocation:
    size: int
    frames: list[dict]
    phase: str
    step: int


@dataclass
class Timeline:
    device: int
    values: list[int]  # bytes allocated after each allocation or free, in order (values[0]: at start)
    phases: list[Phase]
    allocations: list[Allocation]
    baseline: int  # allocated before recording began
    oom: bool

    @property
    def peak(self) -> int:
        return max(self.values)

    @property
    def peak_index(self) -> int:
        return self.values.index(self.peak)

    def phase_at(self, index: int) -> Phase | None:
        return next((p for p in self.phases if p.start <= index < p.end), None)


def _marker_phase(frames) -> str | None:
    for fr in frames or ():
        name = fr.get("name", "") if isinstance(fr, dict) else ""
        if name.startswith(MARK_PREFIX):
            return name[len(MARK_PREFIX):]
    return None


def _final_allocated(snapshot: dict, device: int) -> int:
    total = 0
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") in ("active_allocated", "active_awaiting_free"):
                total += int(block.get("requested_size", block.get("size", 0)))
    return total


def pick_device(snapshot: dict, device: int | None = None) -> int:
    traces = snapshot.get("device_traces") or []
    if device is not None:
        if device >= len(traces):
            raise LmsysError(f"the snapshot has no trace for device {device}")
        return device
    if not traces or not any(traces):
        raise LmsysError("the snapshot has no allocation history (record it with _record_memory_history)")
    return max(range(len(traces)), key=lambda i: len(traces[i]))


def analyze(snapshot: dict, device: int | None = None) -> Timeline:
    """Replay the trace into a timeline of allocated bytes, cut into phases at the markers."""
    device = pick_device(snapshot, device)
    entries = snapshot["device_traces"][device]
    actions = {e.get("action") for e in entries}
    # Allocated bytes drop when the free completes (a block freed on another stream waits for it);
    # traces without completions (older formats) fall back to the request.
    free_action = next(a for a in ("free_completed", "free_requested", "free") if a in actions or a == "free")

    deltas: list[tuple[int, int]] = []  # (entry index, +/- bytes), markers left out
    live: dict[int, int] = {}  # addr -> size of live (non-marker) allocations
    markers: dict[int, str] = {}  # addr -> phase of live marker allocations
    boundaries: list[tuple[int, str]] = []  # (position in deltas, phase that starts there)
    allocations: list[tuple[int, int, list]] = []  # (position, size, frames)
    oom = False
    for i, e in enumerate(entries):
        action = e.get("action")
        addr = e.get("addr")
        if action == "alloc":
            phase = _marker_phase(e.get("frames"))
            if phase is not None:
                markers[addr] = phase
                boundaries.append((len(deltas), phase))
                continue
            size = int(e.get("size", 0))
            live[addr] = size
            allocations.append((len(deltas), size, e.get("frames") or []))
            deltas.append((i, size))
        elif action == free_action:
            if addr in markers:
                markers.pop(addr)
                continue
            size = live.pop(addr, int(e.get("size", 0)))
            deltas.append((i, -size))
        elif action == "oom":
            oom = True

    net = sum(d for _, d in deltas)
    baseline = max(0, _final_allocated(snapshot, device) - net)
    values = [baseline]
    for _, d in deltas:
        values.append(values[-1] + d)

    # Phases: [INIT until the first marker], then one per marker. A delta at position p moves the
    # timeline from values[p] to values[p + 1]; a boundary at position p starts at values[p].
    cuts = [(0, INIT)] + boundaries
    phases: list[Phase] = []
    step = 0
    for k, (pos, name) in enumerate(cuts):
        end = cuts[k + 1][0] if k + 1 < len(cuts) else len(deltas)
        step += name == FWD_STEP
        if name == INIT and k + 1 < len(cuts) and end == 0:
            continue  # nothing before the first marker
        span = values[pos:end + 1]
        peak = max(span)
        phases.append(Phase(step if name != INIT else 0, name, pos, end + 1, span[0], peak,
                            pos + span.index(peak), span[-1]))
    if phases and phases[-1].name == END and phases[-1].start == len(values) - 1:
        phases.pop()  # nothing after the end marker

    allocs = []
    for pos, size, frames in allocations:
        ph = next((p for p in reversed(phases) if p.start <= pos), None)
        allocs.append(Allocation(size, frames, ph.name if ph else INIT, ph.step if ph else 0))
    return Timeline(device, values, phases, allocs, baseline, oom)


# ------------------------------------------------------------------------------------------ tables


def _is_model_frame(frame: dict) -> bool:
    """A Python frame of the user's or lmsys's code: not torch's, not the profiler's own."""
    fn = str(frame.get("filename", "")).replace("\\", "/")
    if not fn.endswith(".py"):
        return False
    return "/torch/" not in fn and "/lmsys/profiling/" not in fn


def _short_path(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def where(frames: list[dict], depth: int = 3) -> str:
    """'model/transformer.py:123 forward ← ...': the innermost `depth` frames of model code."""
    mine = [f for f in frames if _is_model_frame(f)][:depth]
    if mine:
        return " ← ".join(f"{_short_path(f['filename'])}:{f.get('line', '?')} {f.get('name', '?')}" for f in mine)
    if frames:
        f = frames[0]
        return f"{_short_path(str(f.get('filename', '?')))}:{f.get('line', '?')} {f.get('name', '?')}"
    return "(no Python frame: e.g. autograd's engine thread)"


def phase_rows(timeline: Timeline, allocator_peaks: dict[tuple[int, str], int] | None = None) -> list[dict]:
    rows = []
    for p in timeline.phases:
        row = {
            "step": p.step if p.name != INIT else None,
            "phase": p.label,
            "start MiB": p.start_bytes / MiB,
            "peak MiB": p.peak_bytes / MiB,
            "end MiB": p.end_bytes / MiB,
            "added MiB": (p.peak_bytes - p.start_bytes) / MiB,  # what the phase needs on top of its start
        }
        if allocator_peaks is not None:
            peak = allocator_peaks.get((p.step, p.name))
            row["allocator peak MiB"] = None if peak is None else peak / MiB
        rows.append(row)
    return rows


def largest_rows(timeline: Timeline, top: int = 10) -> list[dict]:
    """The largest allocations, grouped by size and code location (a loop over layers -> count)."""
    groups: dict[tuple[int, str], dict] = {}
    for a in timeline.allocations:
        key = (a.size, where(a.frames))
        g = groups.setdefault(key, {"count": 0, "phases": []})
        g["count"] += 1
        label = PHASE_LABELS.get(a.phase, a.phase)
        if label not in g["phases"]:
            g["phases"].append(label)
    ordered = sorted(groups.items(), key=lambda kv: (-kv[0][0], -kv[1]["count"]))[:top]
    return [{"#": i, "size MiB": size / MiB, "count": g["count"], "phase": ", ".join(g["phases"]),
             "allocated at": loc} for i, ((size, loc), g) in enumerate(ordered, 1)]


def summary_row(timeline: Timeline) -> dict:
    """Peak per phase kind (max over steps) and overall: one row of the context-length sweep."""
    def peak_of(name):
        vals = [p.peak_bytes for p in timeline.phases if p.name == name]
        return max(vals) / MiB if vals else None

    return {"peak forward MiB": peak_of(FWD_STEP), "peak backward MiB": peak_of(BWD_STEP),
            "peak optimizer MiB": peak_of(OPTIM_STEP), "peak MiB": timeline.peak / MiB}


# ---------------------------------------------------------------------------------------------- PNG

_PHASE_COLORS = {INIT: "#dddddd", FWD_STEP: "#9ecae1", BWD_STEP: "#fdae6b", OPTIM_STEP: "#a1d99b", END: "#eeeeee"}


def render_png(timeline: Timeline, path: Path, *, title: str) -> Path:
    """Allocated memory over allocator events, phases shaded and labelled, the peak marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    values = timeline.values
    scale, unit = (2**30, "GiB") if max(values) >= 2**30 else (MiB, "MiB")
    ys = [v / scale for v in values]
    fig = Figure(figsize=(11, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    # State k (after k events) is drawn on [k, k+1); the event that leads to state k belongs to the
    # phase holding event k-1, so a phase whose events are p..q-1 covers x from p+0.5 to q+0.5.
    seen = set()
    for p in timeline.phases:
        left = p.start + 0.5 if p.start > 0 else 0
        ax.axvspan(left, p.end - 0.5, color=_PHASE_COLORS.get(p.name, "#eeeeee"), alpha=0.55, lw=0)
        if p.start > 0:
            ax.axvline(left, color="#555555", lw=0.6, ls="--")
        seen.add(p.name)
    ax.step(range(len(ys)), ys, where="post", color="#08306b", lw=1.2)
    peak_i = timeline.peak_index
    ax.plot([peak_i], [ys[peak_i]], "o", color="#cb181d", ms=7, zorder=5)
    at = timeline.phase_at(peak_i)
    where_txt = f" ({at.label}, step {at.step})" if at and at.name != INIT else (f" ({at.label})" if at else "")
    right_half = peak_i > 0.6 * len(ys)
    ax.annotate(f"peak {format_bytes(values[peak_i])}{where_txt}", (peak_i, ys[peak_i]),
                xytext=(-8 if right_half else 8, -14), textcoords="offset points", color="#cb181d", fontsize=9,
                ha="right" if right_half else "left")
    ax.set_xlim(0, max(len(ys) - 0.5, 1))
    ax.set_ylim(0, max(ys) * 1.12 if max(ys) > 0 else 1)
    ax.set_xlabel("allocator events (allocations and frees, in order)")
    ax.set_ylabel(f"allocated ({unit})")
    ax.set_title(title + (" — OOM" if timeline.oom else ""), fontsize=11)
    handles = [Patch(color=_PHASE_COLORS[n], alpha=0.55, label=PHASE_LABELS[n])
               for n in (INIT, FWD_STEP, BWD_STEP, OPTIM_STEP) if n in seen]
    if handles:
        ax.legend(handles=handles, loc="upper left", fontsize=8, ncol=len(handles), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


# ----------------------------------------------------------------------------- what `profile memory` prints


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


def analyze_snapshot(snapshot: dict, path: Path) -> "Timeline":
    """`analyze` of a snapshot file given by the user: a malformed trace is their file to fix (one line)."""
    from lmsys.core.errors import LmsysError

    try:
        return analyze(snapshot)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration) as exc:
        raise LmsysError(f"--snapshot: {path} is not a valid memory snapshot ({type(exc).__name__}: {exc})") from None


def snapshot_reports(timeline: "Timeline", path: Path, *, out_dir: Path, top: int) -> tuple[list, Path]:
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
