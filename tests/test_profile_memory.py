"""`profile memory`: the snapshot replay (exact, on a hand-written trace), the renderer on the captured
fixture, the offline --snapshot path, the error paths, and on a GPU the live capture against
torch.cuda.max_memory_allocated."""

import json
import pickle
from pathlib import Path

import pytest
import torch

from lmsys.profiling import memory_analysis as analysis
from lmsys.profiling import memory_capture as capture
from lmsys.profiling.memory_plot import render_png
from lmsys.profiling.phases import BWD_STEP, FWD_STEP, OPTIM_STEP

FIXTURE = Path(__file__).parent / "fixtures" / "memory" / "snapshot_tiny_train.pickle"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def frames(name, filename="/src/lmsys/model/transformer.py", line=10):
    return [{"filename": filename, "line": line, "name": name}]


def marker(phase):
    return [{"filename": "/src/lmsys/profiling/memory_capture.py", "line": 40, "name": "_marker"},
            {"filename": "/src/lmsys/profiling/memory_capture.py", "line": 50, "name": capture.MARK_PREFIX + phase}]


class Trace:
    """Builds device_traces entries the way the caching allocator records them."""

    def __init__(self, *, completions=True):
        self.entries, self.completions, self.next = [], completions, 0x1000

    def alloc(self, size, fr):
        addr, self.next = self.next, self.next + 4096
        self.entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": fr})
        return addr

    def free(self, addr, size):
        self.entries.append({"action": "free_requested", "addr": addr, "size": size, "stream": 0, "frames": []})
        if self.completions:
            self.entries.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0, "frames": []})

    def mark(self, phase):
        self.free(self.alloc(512, marker(phase)), 512)


def one_step_snapshot(*, completions=True, preexisting=0):
    t = Trace(completions=completions)
    w = t.alloc(1000, frames("__init__"))
    t.mark(FWD_STEP)
    act = t.alloc(300, frames("forward", line=20))
    logits = t.alloc(500, frames("forward", line=30))
    t.mark(BWD_STEP)
    grad = t.alloc(1000, [])
    t.free(logits, 500)
    t.free(act, 300)
    t.mark(OPTIM_STEP)
    state = t.alloc(2000, frames("_init_group", filename="/site-packages/torch/optim/adamw.py"))
    tmp = t.alloc(700, frames("optimizer_step", filename="/src/lmsys/train/step.py", line=70))
    t.free(tmp, 700)
    t.free(grad, 1000)
    t.mark("END")
    live = [(w, 1000), (state, 2000)] + ([(0x99, preexisting)] if preexisting else [])
    blocks = [{"address": a, "size": s + 12, "requested_size": s, "state": "active_allocated", "frames": []}
              for a, s in live] + [{"address": 0x5000, "size": 4096, "state": "inactive"}]
    return {"segments": [{"device": 0, "address": 0, "total_size": 99999, "stream": 0, "blocks": blocks}],
            "device_traces": [t.entries]}


def test_replay_is_exact_per_phase_and_leaves_markers_out():
    tl = analysis.analyze(one_step_snapshot())
    assert tl.baseline == 0
    assert tl.values == [0, 1000, 1300, 1800, 2800, 2300, 2000, 4000, 4700, 4000, 3000]
    got = [(p.name, p.step, p.start_bytes, p.peak_bytes, p.end_bytes) for p in tl.phases]
    assert got == [("init", 0, 0, 1000, 1000), (FWD_STEP, 1, 1000, 1800, 1800), (BWD_STEP, 1, 1800, 2800, 2000),
                   (OPTIM_STEP, 1, 2000, 4700, 3000)]
    assert tl.peak == 4700 and tl.phase_at(tl.peak_index).name == OPTIM_STEP
    assert analysis.summary_row(tl) == {"peak forward MiB": 1800 / 2**20, "peak backward MiB": 2800 / 2**20,
                                      "peak optimizer MiB": 4700 / 2**20, "peak MiB": 4700 / 2**20}
    rows = analysis.phase_rows(tl, {(1, BWD_STEP): 2900})
    assert rows[2]["added MiB"] == 1000 / 2**20 and rows[2]["allocator peak MiB"] == 2900 / 2**20
    assert rows[0]["step"] is None and rows[1]["allocator peak MiB"] is None


def test_replay_without_free_completions_and_with_memory_from_before_the_recording():
    tl = analysis.analyze(one_step_snapshot(completions=False, preexisting=4096))
    assert tl.baseline == 4096 and tl.peak == 4700 + 4096


def test_largest_allocations_name_the_model_code_not_torch():
    rows = analysis.largest_rows(analysis.analyze(one_step_snapshot()), top=3)
    assert [r["size MiB"] * 2**20 for r in rows] == [2000, 1000, 1000]
    assert rows[0]["phase"] == "optimizer" and "adamw.py" in rows[0]["allocated at"]  # only torch frames: innermost
    by_phase = {r["phase"]: r["allocated at"] for r in rows[1:]}
    assert by_phase["init"] == "model/transformer.py:10 __init__"
    assert by_phase["backward"].startswith("(no Python frame")


def test_a_loop_of_equal_allocations_is_one_row_with_a_count():
    t = Trace()
    for _ in range(3):
        t.alloc(256, frames("forward", line=5))
    snap = {"segments": [], "device_traces": [t.entries]}
    rows = analysis.largest_rows(analysis.analyze(snap))
    assert len(rows) == 1 and rows[0]["count"] == 3


def test_fixture_snapshot_phases_peaks_and_png(tmp_path):
    if not FIXTURE.is_file():
        pytest.skip("snapshot fixture not captured")
    tl = analysis.analyze(analysis.load_snapshot(FIXTURE))
    names = [p.name for p in tl.phases]
    assert names[0] == "init" and names[1:4] == [FWD_STEP, BWD_STEP, OPTIM_STEP]
    assert names.count(FWD_STEP) >= 2  # --steps 2
    assert tl.peak == max(p.peak_bytes for p in tl.phases) > 0
    for p in tl.phases:
        assert p.start_bytes <= p.peak_bytes and p.end_bytes <= p.peak_bytes
        assert min(tl.values[p.start:p.end]) >= 0
    second_fwd = [p for p in tl.phases if p.name == FWD_STEP][1]
    first_fwd = [p for p in tl.phases if p.name == FWD_STEP][0]
    assert second_fwd.start_bytes > first_fwd.start_bytes  # AdamW's state lives on after step 1
    rows = analysis.largest_rows(tl, top=5)
    assert rows[0]["size MiB"] >= rows[-1]["size MiB"] and any("transformer.py" in r["allocated at"] for r in rows)
    png = render_png(tl, tmp_path / "t.png", title="fixture")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def test_snapshot_option_renders_offline(lmsys, tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(one_step_snapshot()))
    r = lmsys("profile", "memory", "--snapshot", str(path), "--out-dir", str(tmp_path), "--format", "json")
    assert r.code == 0, r.err
    phases, largest = json.loads(r.out)
    assert [row["phase"] for row in phases["rows"]] == ["init", "forward", "backward", "optimizer"]
    assert phases["rows"][3]["peak MiB"] == pytest.approx(4700 / 2**20)
    assert (tmp_path / "snap.png").read_bytes()[:8] == PNG_MAGIC


def test_an_interrupted_png_or_pickle_leaves_nothing_at_the_final_path(lmsys, monkeypatch, tmp_path):
    """The timeline PNG and the snapshot pickle are written under a temporary name and renamed when
    complete: an interrupt midway leaves neither a partial file nor the temporary one."""
    from matplotlib.figure import Figure

    from lmsys.core.errors import Interrupted

    def half_then_signal(self, path, **kw):
        Path(path).write_bytes(PNG_MAGIC)
        raise Interrupted(2)

    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(one_step_snapshot()))
    out = tmp_path / "out"
    monkeypatch.setattr(Figure, "savefig", half_then_signal)
    r = lmsys("profile", "memory", "--snapshot", str(path), "--out-dir", str(out))
    assert r.code == 130 and "interrupted" in r.err, r.err
    assert list(out.iterdir()) == []

    def dump_half(obj, f):
        f.write(b"\x80\x04partial")
        raise Interrupted(15)

    monkeypatch.setattr(capture.pickle, "dump", dump_half)
    with pytest.raises(Interrupted):
        capture.write_snapshot({"segments": []}, out / "run.pickle")
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    capture.write_snapshot({"segments": []}, out / "run.pickle")
    assert pickle.loads((out / "run.pickle").read_bytes()) == {"segments": []}


def test_snapshot_errors_are_exit_2(lmsys, tmp_path):
    assert lmsys("profile", "memory", "--snapshot", str(tmp_path / "missing.pickle")).code == 2
    (tmp_path / "junk.pickle").write_bytes(b"not a pickle")
    assert lmsys("profile", "memory", "--snapshot", str(tmp_path / "junk.pickle")).code == 2
    (tmp_path / "list.pickle").write_bytes(pickle.dumps([1, 2]))
    assert lmsys("profile", "memory", "--snapshot", str(tmp_path / "list.pickle")).code == 2
    # a pickle that would construct an object (run code) is refused, not loaded
    (tmp_path / "obj.pickle").write_bytes(pickle.dumps({"device_traces": [], "x": Path("/")}))
    r = lmsys("profile", "memory", "--snapshot", str(tmp_path / "obj.pickle"))
    assert r.code == 2 and "refusing" in r.err


def test_live_run_without_cuda_is_one_line_exit_2(lmsys):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour")
    r = lmsys("profile", "memory", "--size", "tiny")
    assert r.code == 2
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "--snapshot" in lines[0]
    assert lmsys("profile", "memory", "--context-length", "0,128").code == 2


@pytest.mark.gpu
def test_live_capture_on_cuda_matches_the_allocator(tmp_path):
    from lmsys.train import Workload
    from lmsys.model.config import PRESETS

    dev = torch.device("cuda")
    workload = Workload(PRESETS["tiny"].with_overrides(context_length=128), batch_size=4)
    before = torch.cuda.memory_allocated(dev)  # what earlier tests in this process still hold
    cap = capture.capture(workload, dev, mode="train", steps=2)
    tl = analysis.analyze(cap.snapshot, cap.device_index)
    assert [p.name for p in tl.phases][:4] == ["init", FWD_STEP, BWD_STEP, OPTIM_STEP]
    assert tl.baseline <= before + 2**20
    # the allocator counts block sizes (rounded up to 512 B; a reused large block may exceed the request
    # by up to 1 MiB), the trace requested sizes: allocator >= trace, and close
    for p in tl.phases:
        alloc_peak = cap.allocator_peaks.get((p.step, p.name))
        if alloc_peak is not None:
            assert alloc_peak >= p.peak_bytes, p
            assert alloc_peak == pytest.approx(p.peak_bytes, rel=0.15, abs=16 * 2**20), p
    assert cap.allocator_peak == pytest.approx(tl.peak, rel=0.15, abs=16 * 2**20)
    path = capture.write_snapshot(cap.snapshot, tmp_path / "s.pickle")
    assert analysis.load_snapshot(path)["device_traces"]
