import csv
import io
import json
import time

import pytest
import torch

from lmsys.core.errors import LmsysError
from lmsys.core.flops import attention_flops, mfu, model_flops
from lmsys.core.parsing import format_bytes, parse_bytes, parse_int_list
from lmsys.core.results import NOT_MEASURED, MeanStd, Report, render, to_csv, to_json, to_markdown
from lmsys.core.timing import RegionTimer, Stats


def test_timer_measures_a_known_sleep():
    timer = RegionTimer("cpu")
    for _ in range(5):
        with timer.region("sleep"):
            time.sleep(0.02)
    stats = timer.stats()["sleep"]
    assert stats.n == 5
    assert 19.5 <= stats.median <= 40
    assert stats.min >= 19.5


def test_region_timer_nested_regions():
    timer = RegionTimer("cpu")
    for _ in range(3):
        with timer.region("step"):
            with timer.region("a"):
                time.sleep(0.005)
            with timer.region("b"):
                time.sleep(0.01)
    s = timer.stats()
    assert set(s) == {"step", "a", "b"}
    assert s["b"].mean > s["a"].mean
    assert s["step"].mean >= s["a"].mean + s["b"].mean - 0.5


def test_stats():
    s = Stats((1.0, 2.0, 3.0, 10.0))
    assert (s.mean, s.median, s.min) == (4.0, 2.5, 1.0)
    assert s.std == pytest.approx(4.0825, rel=1e-4)
    assert Stats((5.0,)).std == 0.0


REPORT = Report(
    "demo",
    [{"name": "a", "ms": MeanStd(1.2345, 0.1), "n": 1000, "x": None},
     {"name": "b", "ms": MeanStd(20.0, 2.0), "n": 3, "x": 0.5}],
    meta={"device": "cpu", "torch": "2.x"},
    notes=["a note"],
)


def test_markdown_renderer():
    md = to_markdown(REPORT)
    assert "| name | ms | n | x |" in md
    assert "| a | 1.23 ± 0.10 | 1,000 | — |" in md
    assert "- **device**: cpu" in md and "a note" in md


def test_markdown_renderer_exact_bytes():
    # The docs paste these tables: unpadded cells, a `|---|` rule, numbers as `_fmt` wrote them (tabulate
    # must not re-parse "007" or "1e3"), a missing cell as an em dash.
    report = Report(
        "demo",
        [{"config": "small", "ms/step": MeanStd(12.345, 0.25), "tokens/s": 81234.5, "code": "007"},
         {"config": "1e3", "ms/step": None, "status": "OOM"}],
        meta={"device": "cpu", "steps": 10},
        notes=["ms/step: mean ± std over 10 steps."],
    )
    assert to_markdown(report) == (
        "### demo\n"
        "\n"
        "- **device**: cpu\n"
        "- **steps**: 10\n"
        "\n"
        "| config | ms/step | tokens/s | code | status |\n"
        "|---|---|---|---|---|\n"
        "| small | 12.35 ± 0.25 | 81,234 | 007 | — |\n"
        "| 1e3 | — | — | — | OOM |\n"
        "\n"
        "ms/step: mean ± std over 10 steps.\n"
    )


def test_csv_renderer_expands_mean_std():
    text = to_csv(REPORT)
    rows = list(csv.DictReader(io.StringIO(text)))  # plain CSV: the header first, no comment lines
    assert rows[0]["ms"] == "1.2345" and rows[0]["ms std"] == "0.1"
    assert rows[1]["n"] == "3" and rows[0]["x"] == ""
    assert not any(line.startswith("#") for line in text.splitlines()) and "device" not in text


def test_json_renderer():
    doc = json.loads(to_json(REPORT))
    assert doc["rows"][1]["ms"] == {"mean": 20.0, "std": 2.0}
    assert doc["meta"]["torch"] == "2.x" and doc["notes"] == ["a note"]


def test_rich_renderer_and_output_file(tmp_path, capsys):
    out = tmp_path / "r.json"
    render(REPORT, "table", out)
    printed = capsys.readouterr().out
    assert "demo" in printed and "1.23 ± 0.10" in printed
    assert json.loads(out.read_text())["title"] == "demo"  # format from the extension
    assert not list(tmp_path.glob(".*tmp*"))
    render([REPORT, REPORT], "json", tmp_path / "two.json")
    assert len(json.loads((tmp_path / "two.json").read_text())) == 2


def test_not_measured_is_not_missing(capsys):
    """None (nothing to measure) reads —; NOT_MEASURED (there is something, lmsys cannot time it) reads n/m in
    every format, and a column of numbers and n/m stays right-aligned on the terminal."""
    report = Report("nm", [{"impl": "lmsys", "comm ms": 1.5, "bubble %": None},
                           {"impl": "torch", "comm ms": NOT_MEASURED, "bubble %": None}])
    assert "| torch | n/m | — |" in to_markdown(report)
    assert to_csv(report).splitlines()[-1] == "torch,n/m,"
    assert json.loads(to_json(report))["rows"][1] == {"impl": "torch", "comm ms": "n/m", "bubble %": None}
    render(report, "table")
    printed = capsys.readouterr().out
    assert " n/m " in printed and "  1.50 " in printed.replace("│", " ")


def test_rich_renderer_prints_brackets_as_text(capsys):
    """Cells, meta values and notes are text, not Rich markup: "[hf]" and "[batch, seq, d]" survive."""
    report = Report("brackets", [{"what": "the [hf] extra", "n": 1}], {"model": "[bold]x[/bold]"},
                    ["gets CS336's [batch, seq, d] and [dim]"])
    render(report, "table")
    printed = capsys.readouterr().out
    for text in ("the [hf] extra", "[bold]x[/bold]", "[batch, seq, d] and [dim]"):
        assert text in printed


def test_parsing():
    assert parse_bytes("1MB") == 10**6 and parse_bytes("1MiB") == 2**20 and parse_bytes("4096") == 4096
    assert parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(LmsysError):
        parse_bytes("lots")
    assert parse_int_list("2, 4,6", what="--world-size") == [2, 4, 6]
    with pytest.raises(LmsysError):
        parse_int_list("2,x", what="--world-size")
    assert format_bytes(1536) == "1.5 KiB"


def test_model_flops_match_torch_flop_counter():
    """The 2·N·tokens + attention forward count equals what PyTorch counts op by op."""
    from torch.utils.flop_counter import FlopCounterMode

    from lmsys.model import ModelConfig
    from lmsys.model.transformer import TransformerLM

    cfg = ModelConfig(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=100, context_length=32)
    model = TransformerLM(cfg)
    x = torch.randint(0, 100, (3, 32))
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert counter.get_total_flops() == model_flops(cfg, batch_size=3, seq_len=32, backward=False)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    # Backward counts 2× forward for weights; the input-grad of the first layer is counted as well.
    assert counter.get_total_flops() == pytest.approx(model_flops(cfg, batch_size=3, seq_len=32, backward=True), rel=0.02)


def test_attention_flops_and_mfu():
    f = attention_flops(batch=1, heads=16, n_queries=16384, n_keys=16384, d_head=64, causal=True, direction="fwd")
    assert f == 4 * 16 * 16384**2 * 64 / 2
    assert attention_flops(batch=1, heads=1, n_queries=2, n_keys=2, d_head=2, causal=False, direction="fwd+bwd") == 3.5 * 32
    assert mfu(1e12, 1000.0, 2.0) == pytest.approx(0.5)
    assert mfu(1e12, 1000.0, None) is None


def test_markdown_escapes_pipes_in_headers_and_cells():
    from lmsys.core.results import markdown_table

    table = markdown_table(["size", "|Δloss|"], [["a|b", "1"]])
    assert table.splitlines() == ["| size | \\|Δloss\\| |", "|---|---|", "| a\\|b | 1 |"]


# ------------------------------------------------------------------ the timer's CUDA-graph and profiler modes


def test_time_graph_and_kernel_ms_fall_back_to_the_host_clock_on_a_cpu():
    from lmsys.core.timing import kernel_ms, time_graph

    calls = []

    def sleep():
        calls.append(1)
        time.sleep(0.01)

    stats = time_graph(sleep, warmup=1, steps=3, device="cpu")
    assert stats.n == 3 and 9.5 <= stats.median <= 30 and len(calls) == 4
    assert 9.5 <= kernel_ms(sleep, warmup=0, steps=2, device="cpu") <= 30


def test_time_graph_replays_a_capture_of_reps_calls_per_sample(monkeypatch):
    # the GPU path with stand-ins for torch.cuda's streams, graph and events: the warm-up runs on a side
    # stream before the capture, `reps` calls are captured once, each replay re-runs them inside the timer's
    # region (events read on the host clock here) and a sample is the replay's time over reps
    from lmsys.core import timing

    log, captured = [], []

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            log.append("wait")

    class Graph:
        def replay(self):
            for f in captured:
                f()

    capturing = []

    class Capture:
        def __init__(self, graph):
            pass

        def __enter__(self):
            capturing.append(True)

        def __exit__(self, *exc):
            capturing.clear()

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    class SideStream:
        def __init__(self, stream):
            pass

        def __enter__(self):
            log.append("side")

        def __exit__(self, *exc):
            log.append("main")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", SideStream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    calls = []

    def fn():
        if capturing:
            captured.append(lambda: time.sleep(0.004))
        else:
            calls.append(log[-1])
            time.sleep(0.004)

    stats = timing.time_graph(fn, warmup=2, steps=3, device=torch.device("cuda"), reps=4)
    assert calls == ["side", "side"] and len(captured) == 4  # warm-up on the side stream; 4 calls captured
    assert stats.n == 3 and 3.9 <= stats.median <= 12  # a replay of 4 × 4 ms, over 4


class _Event:
    def __init__(self, name, device_type, us, annotation=False, parent=None):
        self.name, self.device_type, self.is_user_annotation, self.cpu_parent = name, device_type, annotation, parent
        self.time_range = type("Range", (), {"elapsed_us": lambda _self: us})()


def _stand_in_profiler(monkeypatch, events, activity):
    import torch.profiler

    class Profile:
        def __init__(self, activities):
            assert activities == [activity]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_kernel_ms_sums_the_profilers_device_events_per_call(monkeypatch):
    # the GPU path with a stand-in profiler: device-typed events (kernels, copies) summed and divided by
    # the calls, by name in kernel_times; host events (launches) and user annotations on the device left out
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from lmsys.core.timing import kernel_ms, kernel_times

    events = [_Event("gemm", DeviceType.CUDA, 300.0), _Event("gemm", DeviceType.CUDA, 100.0),
              _Event("copy", DeviceType.CUDA, 60.0), _Event("cudaLaunchKernel", DeviceType.CPU, 5000.0),
              _Event("step", DeviceType.CUDA, 7000.0, annotation=True)]
    _stand_in_profiler(monkeypatch, events, ProfilerActivity.CUDA)
    calls = []
    ms = kernel_ms(lambda: calls.append(1), device=torch.device("cuda"), warmup=1, steps=2)
    assert ms == pytest.approx(0.23) and len(calls) == 3  # (300 + 100 + 60) µs over 2 calls; one warm-up call
    assert kernel_times(lambda: None, device=torch.device("cuda"), warmup=0, steps=2) == \
        pytest.approx({"gemm": 0.2, "copy": 0.03})
    _stand_in_profiler(monkeypatch, [], ProfilerActivity.CUDA)  # under nsys or ncu: no kernels recorded
    assert kernel_ms(lambda: None, device=torch.device("cuda"), warmup=0, steps=1) == 0.0


def test_kernel_times_on_a_cpu_are_the_top_level_ops():
    # unpatched: a linear layer and an elementwise op under the real profiler; the enclosing ops are kept
    # (their children, aten::addmm inside aten::linear, are not counted twice) and add up to no more than
    # the calls' wall time
    from lmsys.core.timing import kernel_times

    x, w = torch.randn(64, 256), torch.randn(512, 256)

    def fn():
        torch.nn.functional.linear(x, w).relu_()

    start = time.perf_counter()
    times = kernel_times(fn, warmup=1, steps=3, device="cpu")
    wall_ms = (time.perf_counter() - start) * 1e3 / 3
    assert {"aten::linear", "aten::relu_"} <= set(times) and "aten::addmm" not in times
    assert all(ms > 0 for ms in times.values()) and sum(times.values()) <= wall_ms


# ------------------------------------------------------------------ the one bus-factor table


def _ring_bytes_per_rank(collective: str, n: int, numel: int) -> float:
    """Elements each rank sends in a ring implementation of `collective` over a buffer of `numel` (the full
    buffer, as nccl-tests counts it), run for real on Python lists: an independent count of what crosses a
    link. The results are checked too."""
    import random

    chunk = numel // n
    data = [[random.randint(0, 9) for _ in range(numel)] for _ in range(n)]
    sent = [0] * n
    if collective in ("all-reduce", "reduce-scatter"):
        buf = [list(d) for d in data]
        for step in range(n - 1):  # reduce-scatter: n-1 steps, each rank passes one chunk to the next
            for r in range(n):
                c = (r - step) % n
                dst = (r + 1) % n
                part = buf[r][c * chunk:(c + 1) * chunk]
                sent[r] += len(part)
                for i, v in enumerate(part):
                    buf[dst][c * chunk + i] += v
        total = [sum(d[i] for d in data) for i in range(numel)]
        for r in range(n):  # rank r holds the full sum of chunk r+1
            c = (r + 1) % n
            assert buf[r][c * chunk:(c + 1) * chunk] == total[c * chunk:(c + 1) * chunk]
        if collective == "all-reduce":  # then an all-gather of the reduced chunks
            for step in range(n - 1):
                for r in range(n):
                    c = (r + 1 - step) % n
                    dst = (r + 1) % n
                    buf[dst][c * chunk:(c + 1) * chunk] = buf[r][c * chunk:(c + 1) * chunk]
                    sent[r] += chunk
            assert all(b == total for b in buf)
    elif collective == "all-gather":  # rank r owns chunk r of the output
        out = [[None] * numel for _ in range(n)]
        for r in range(n):
            out[r][r * chunk:(r + 1) * chunk] = data[r][r * chunk:(r + 1) * chunk]
        for step in range(n - 1):
            for r in range(n):
                c = (r - step) % n
                out[(r + 1) % n][c * chunk:(c + 1) * chunk] = out[r][c * chunk:(c + 1) * chunk]
                sent[r] += chunk
        expect = [v for r in range(n) for v in data[r][r * chunk:(r + 1) * chunk]]
        assert all(o == expect for o in out)
    elif collective == "broadcast":  # a chain from rank 0, pipelined: every rank but the last forwards it all
        for r in range(n - 1):
            sent[r] += numel
        return max(sent)
    elif collective == "send-recv":  # each rank sends its whole buffer to its peer
        return numel
    return max(sent)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_factors_are_nccl_tests_formulas_and_what_a_ring_sends(n):
    # one table (lmsys.core.collectives) behind comm's busbw and the planner's collective times; each factor
    # is nccl-tests' (PERFORMANCE.md: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast
    # and sendrecv 1) and equals the elements a ring sends per rank over the buffer's, counted by running it
    from lmsys.bench import comm
    from lmsys.core.collectives import BUS_FACTORS, bus_factor
    from lmsys.plan import time as ptime

    assert comm.BUS_FACTORS is BUS_FACTORS and ptime.BUS_FACTORS is BUS_FACTORS
    assert comm.bus_factor is bus_factor and ptime.bus_factor is bus_factor
    nccl_tests = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
                  "broadcast": 1.0, "send-recv": 1.0}
    assert set(BUS_FACTORS) == set(nccl_tests)
    numel = 12 * n
    for name, factor in nccl_tests.items():
        assert bus_factor(name, n) == pytest.approx(factor) == BUS_FACTORS[name](n) == BUS_FACTORS[name][1](n)
        if n > 1 or name == "send-recv":
            assert _ring_bytes_per_rank(name, n, numel) / numel == pytest.approx(factor), name
    assert bus_factor("send", n) == 1.0  # the planner's pipeline send
    with pytest.raises(ValueError, match="all-to-all"):
        bus_factor("all-to-all", n)
