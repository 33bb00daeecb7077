"""Replay a memory snapshot offline (no GPU needed): allocated bytes over time, cut into phases.

The allocated-bytes timeline is replayed from the trace (alloc + size, free − size, in order; sizes as
requested, as memory_viz shows them), shifted by what was already allocated when recording began (what
the final state holds that the trace does not explain). Phases start at memory_capture's marker
allocations, which are left out of every number. From the timeline: peak memory per phase, and the
largest allocations with the Python frames that made them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

from lmsys.core.errors import LmsysError
from lmsys.core.parsing import MiB
from lmsys.profiling.memory_capture import END, INIT, MARK_PREFIX
from lmsys.profiling.phases import BWD_STEP, FWD_STEP, OPTIM_STEP

PHASE_LABELS = {INIT: "init", FWD_STEP: "forward", BWD_STEP: "backward", OPTIM_STEP: "optimizer", END: "after"}


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


def analyze_snapshot(snapshot: dict, path: Path) -> Timeline:
    """`analyze` of a snapshot file given by the user: a malformed trace is their file to fix (one line)."""
    try:
        return analyze(snapshot)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration) as exc:
        raise LmsysError(f"--snapshot: {path} is not a valid memory snapshot ({type(exc).__name__}: {exc})") from None
