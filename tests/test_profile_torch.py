"""`profile nsys --engine torch` end to end on `tiny` (a CPU in CI; kernels instead of operators on a GPU)."""

import json

import pytest
import torch

from lmsys.profiling import torch_engine
from lmsys.profiling.summary import Timed

COMMON = ("profile", "nsys", "--engine", "torch", "--size", "tiny", "--context-length", "32", "--batch-size", "2",
          "--warmup", "1", "--steps", "2")


def test_torch_engine_end_to_end_on_tiny(lmsys, tmp_path):
    out = tmp_path / "prof"
    r = lmsys(*COMMON, "--annotate-attention", "--out-dir", str(out), "--format", "json")
    assert r.code == 0, r.err
    docs = json.loads(r.out)
    ranges = {row["range"]: row for row in docs[0]["rows"]}
    for phase in ("FWD_STEP", "BWD_STEP", "OPTIM_STEP"):
        assert ranges[phase]["instances"] == 2  # the measured steps only: the warm-up step is not recorded
        assert ranges[phase]["total ms"] > 0 and ranges[phase]["avg ms"] > 0
    assert all(0 < ranges[p]["% of step"] < 100 for p in ("FWD_STEP", "BWD_STEP", "OPTIM_STEP"))
    # 2 layers x 2 steps of the annotated attention, nested inside FWD_STEP
    assert ranges["ATTN_SOFTMAX"]["instances"] == 4
    assert ranges["ATTN_SOFTMAX"]["total ms"] < ranges["FWD_STEP"]["total ms"]
    titles = [d["title"] for d in docs]
    unit = "kernels" if torch.cuda.is_available() else "operators"
    assert any(t.startswith(f"top 10 {unit}") and t.endswith("in FWD_STEP") for t in titles)
    split = next(d for d in docs if d["title"] == "attention: matmul vs softmax")
    assert all(row["calls"] == 4 for row in split["rows"][:3])  # each part once per layer and step
    trace = out / "torch_tiny_ctx32_b2_fp32_train_attn.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "BWD_STEP" for e in events)
    assert "chrome trace:" in r.err


def test_torch_engine_fwd_mode_times_the_forward_only(lmsys, tmp_path):
    r = lmsys(*COMMON, "--mode", "fwd", "--range", "BWD_STEP", "--out-dir", str(tmp_path), "--format", "json")
    assert r.code == 0, r.err
    times, *tops = json.loads(r.out)
    [fwd] = times["rows"]  # no backward or optimizer range in fwd mode
    assert (fwd["range"], fwd["instances"]) == ("FWD_STEP", 2)
    assert fwd["avg ms"] == pytest.approx(fwd["total ms"] / 2) and fwd["% of step"] == pytest.approx(100.0)
    [top] = tops  # only the table over all steps: nothing ran in BWD_STEP
    assert top["rows"] and sum(row["%"] for row in top["rows"]) <= 100 + 1e-6
    assert any(note.startswith("No ") and "recorded in range 'BWD_STEP'" in note for note in top["notes"])
    if not torch.cuda.is_available():  # operators: each Linear is one aten::mm per forward
        layers = 2  # tiny
        mm = next(row for row in top["rows"] if row["operator"] == "aten::mm")
        assert mm["calls"] == 2 * (5 * layers + 1)  # qkv, out, 3 SwiGLU per block, and the LM head; 2 steps


def test_operators_are_attributed_to_the_range_they_ran_in():
    """A stand-in event list: containment in time, on any thread; ranges and profiler steps excluded."""

    class Span:
        def __init__(self, start, end):
            self.start, self.end = start, end

    class Ev:
        def __init__(self, name, start, end, self_us):
            self.name, self.time_range, self.self_cpu_time_total = name, Span(start, end), self_us
            self.device_type = "DeviceType.CPU"
            self.kernels = []

    events = [Ev("FWD_STEP", 0, 100, 1), Ev("BWD_STEP", 100, 300, 1), Ev("FWD_STEP", 400, 500, 1),
              Ev("ProfilerStep#1", 0, 310, 1), Ev("aten::mm", 10, 20, 10), Ev("aten::mm", 410, 430, 20),
              Ev("aten::mul", 150, 160, 5), Ev("aten::add", 350, 360, 7)]
    prof = torch_engine.summarize_events(events, cuda=False)
    fwd = prof.range("FWD_STEP")
    assert fwd.instances == 2 and fwd.total_ns == 200_000 and fwd.device_ns is None
    assert prof.by_range["FWD_STEP"] == [Timed("aten::mm", 2, 30_000)]
    assert prof.by_range["BWD_STEP"] == [Timed("aten::mul", 1, 5_000)]
    assert [t.name for t in prof.top] == ["aten::mm", "aten::add", "aten::mul"]  # outside ranges too


def test_the_cli_run_prints_no_kineto_usdt_lines(tmp_path):
    """Kineto writes `USDT:... profiler_start` / `profiler_stop` to the C-level stderr at each trace start
    and stop, once per process: a fresh `lmsys` process shows only lmsys's own stderr line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import lmsys

    env = dict(os.environ, PYTHONPATH=str(Path(lmsys.__file__).resolve().parents[1]))
    env.pop("KINETO_LOG_LEVEL", None)
    proc = subprocess.run([sys.executable, "-m", "lmsys", *COMMON[:-2], "--device", "cpu", "--steps", "1",
                           "--out-dir", str(tmp_path), "--format", "json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "USDT" not in proc.stderr and "profiler_start" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("chrome trace:"), proc.stderr
    assert json.loads(proc.stdout)[0]["rows"]  # the tables still reach stdout


def test_usdt_filter_keeps_every_other_stderr_line_in_order(capfd):
    import os

    with torch_engine.without_usdt_lines():
        os.write(2, b"USDT:2026-12-01 00:58:30 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR:kineto says something real\n")
        os.write(2, b"USDT:... profiler_stop\nlast line without newline")
    os.write(2, b"\nafter: fd 2 is back\n")
    err = capfd.readouterr().err
    assert err == "ERROR:kineto says something real\nlast line without newline\nafter: fd 2 is back\n"
