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
