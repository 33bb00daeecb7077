"""`lmsys bench attention` through the real CLI entry point and its library (lmsys.bench.attention)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from lmsys.bench import attention as bench_attention
from lmsys.core.errors import LmsysError
from lmsys.core.flops import attention_flops


def _rows(out: str) -> list[dict]:
    return json.loads(out)["rows"]


def test_bench_attention_rows_and_flops(lmsys):
    r = lmsys("bench", "attention", "--device", "cpu", "--impl", "naive", "--impl", "flash-torch,sdpa",
              "--d-head", "16", "--seq-len", "32,48", "--batch", "2", "--heads", "3", "--warmup", "0",
              "--steps", "2", "--causal", "--format", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    rows = doc["rows"]
    assert [(row["impl"], row["seq"]) for row in rows] == [
        ("naive", 32), ("naive", 48), ("flash-torch", 32), ("flash-torch", 48), ("sdpa", 32), ("sdpa", 48)]
    assert "causal" in doc["meta"]["run"] and "fp32" in doc["meta"]["run"]
    for row in rows:
        assert row["status"] == "ok" and row["batch"] == 2 and row["heads"] == 3 and row["d"] == 16
        fwd = row["fwd ms"]["mean"]
        flops = attention_flops(batch=2, heads=3, n_queries=row["seq"], n_keys=row["seq"], d_head=16,
                                causal=True, direction="fwd")
        assert row["fwd TFLOP/s"] == pytest.approx(flops / (fwd * 1e-3) / 1e12)
        assert row["fwd+bwd ms"]["mean"] >= row["fwd ms"]["mean"]
        assert row["peak fwd MiB"] is None  # memory is a GPU column
        assert row["host µs"] > 0 and list(row)[-2:] == ["host µs", "status"]
    assert any("host µs: median host time to issue one forward+backward" in note for note in doc["notes"])
    assert not any("fp32 dots" in note for note in doc["notes"])  # no flash-triton here


def test_bench_attention_says_what_flash_tritons_fp32_dots_are(lmsys):
    """fp32 with flash-triton: a note names its dots' precision (tf32x3 under the interpreter) and torch's
    setting it follows."""
    r = lmsys("bench", "attention", "--device", "cpu", "--impl", "flash-triton", "--d-head", "16", "--seq-len", "40",
              "--batch", "1", "--heads", "1", "--warmup", "0", "--steps", "1", "--format", "json")
    assert r.code == 0, r.err
    notes = json.loads(r.out)["notes"]
    assert any(note.startswith("flash-triton's fp32 dots: tf32x3 (torch's float32 matmul precision 'highest'")
               for note in notes), notes


def test_host_us_is_the_median_issue_time_of_min_host_calls_steps(monkeypatch):
    """`host µs`: min(HOST_CALLS, steps) calls of one forward+backward, each timed alone, the median in µs."""
    times = iter([0.0, 1e-6, 10.0, 10.000005, 20.0, 20.000003])
    monkeypatch.setattr(time, "perf_counter", lambda: next(times))
    calls = []
    assert bench_attention._host_us(lambda: calls.append(1), torch.device("cpu"), 3) == pytest.approx(3.0)
    assert len(calls) == 3


def test_bench_attention_cpu_defaults_are_small(lmsys, monkeypatch):
    seen = []

    def fake_measure(impl, batch, heads, d, seq, sweep, device, policy=None):
        seen.append((impl, batch, heads, d, seq, sweep.steps))
        return {"status": "ok"}

    monkeypatch.setattr(bench_attention, "_measure", fake_measure)
    r = lmsys("bench", "attention", "--device", "cpu", "--format", "md")
    assert r.code == 0, r.err
    assert {s[0] for s in seen} == {"naive", "flash-torch"}
    assert max(s[4] for s in seen) <= 256 and all(s[1] == 1 for s in seen)
    assert "CPU without sizes" in r.out


def test_bench_attention_seed_and_leaderboard_sweeps():
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    seed = bench_attention.SEED
    assert (seed.batch, seed.heads, seed.d_head, seed.seq_len) == ((8,), (1,), (16, 32, 64, 128),
                                                                    (256, 1024, 4096, 8192, 16384))
    assert seed.steps == 100
    board = bench_attention.PRESETS["leaderboard"]
    assert (board.dtype, board.causal, board.batch, board.heads, board.seq_len, board.d_head) == (
        "bf16", True, (1,), (16,), (16384,), (64,))
    if cuda is not None:
        sweep, _ = bench_attention.resolve_sweep(device=cuda, preset="leaderboard", seq_len=[65536])
        assert sweep.seq_len == (65536,) and sweep.heads == (16,) and sweep.causal


def test_bench_attention_preset_with_overrides_on_cpu(lmsys):
    r = lmsys("bench", "attention", "--device", "cpu", "--preset", "leaderboard", "--impl", "flash-torch",
              "--seq-len", "40", "--heads", "2", "--warmup", "0", "--steps", "1", "--format", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert "bf16" in doc["meta"]["run"] and "causal" in doc["meta"]["run"]
    assert [(row["impl"], row["heads"], row["d"], row["seq"]) for row in doc["rows"]] == [("flash-torch", 2, 64, 40)]


def test_bench_attention_oom_rows_continue(monkeypatch):
    calls = []

    def fake_measure(impl, batch, heads, d, seq, sweep, device, policy=None):
        calls.append(seq)
        if seq == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"status": "ok"}

    monkeypatch.setattr(bench_attention, "_measure", fake_measure)
    sweep, _ = bench_attention.resolve_sweep(device=torch.device("cpu"), impls=["naive"], d_head=[16],
                                             seq_len=[32, 64, 128])
    rows = list(bench_attention.run_attention(sweep, device=torch.device("cpu")))
    assert calls == [32, 64, 128]
    assert [r["status"] for r in rows] == ["ok", "OOM", "ok"]


def test_bench_attention_plot(lmsys, tmp_path):
    png = tmp_path / "attn.png"
    r = lmsys("bench", "attention", "--device", "cpu", "--impl", "naive", "--d-head", "16", "--seq-len", "16,32",
              "--warmup", "0", "--steps", "1", "--plot", str(png), "--format", "csv")
    assert r.code == 0, r.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_a_panel_per_head_dim_and_a_colour_per_implementation(monkeypatch, tmp_path):
    """Four head dims × three implementations: four panels, each implementation one colour in all of them
    (the seed's sweep drew 12 lines in one panel, where ten colours repeat), lengths in order."""
    import matplotlib.pyplot as plt

    from lmsys.core.timing import Stats

    rows = [{"status": "ok", "impl": impl, "d": d, "batch": 8, "heads": 1, "dtype": "bf16", "seq": seq,
             "fwd+bwd ms": Stats((0.1 * (i + 1) * seq / 256,))}
            for i, impl in enumerate(("flash-triton", "sdpa-cudnn", "sdpa-flash"))
            for d in (128, 16, 64, 32) for seq in (1024, 256)]
    figures = []
    monkeypatch.setattr(bench_attention, "save_figure", lambda fig, path, **kw: figures.append(fig))
    monkeypatch.setattr(plt, "close", lambda fig: None)
    bench_attention.plot_attention(rows, tmp_path / "p.png", title="t")
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["d = 16", "d = 32", "d = 64", "d = 128"]
    colours = {}
    for ax in panels:
        assert len(ax.lines) == 3
        for line in ax.lines:
            colours.setdefault(line.get_label(), set()).add(line.get_color())
            assert list(line.get_xdata()) == [256, 1024]
    assert sorted(colours) == ["flash-triton bf16", "sdpa-cudnn bf16", "sdpa-flash bf16"]
    assert all(len(c) == 1 for c in colours.values()) and len({next(iter(c)) for c in colours.values()}) == 3
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["flash-triton bf16", "sdpa-cudnn bf16",
                                                                  "sdpa-flash bf16"]


@pytest.mark.parametrize("args,needle", [
    (("--impl", "flashy"), "--impl must be one of"),
    (("--preset", "fast"), "--preset must be one of leaderboard"),
    (("--seq-len", "0"), "--seq-len must be >= 1"),  # named as typed (the alias of --context-length)
    (("--context-length", "0"), "--context-length must be >= 1"),
    (("--steps", "0"), "--steps"),
    (("--dtype", "fp16"), "fp16"),
    (("--plot", "/nonexistent/dir/a.png"), "--plot: directory /nonexistent/dir does not exist"),
])
def test_bench_attention_user_errors(lmsys, args, needle):
    r = lmsys("bench", "attention", "--device", "cpu", *args)
    assert r.code == 2 and needle in r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) <= 2


def test_output_or_plot_that_is_a_directory_is_a_user_error(lmsys, tmp_path):
    for option in ("--output", "--plot"):
        r = lmsys("bench", "attention", "--device", "cpu", option, str(tmp_path))
        assert r.code == 2 and f"{option}: {tmp_path} is a directory" in r.err
        assert list(tmp_path.iterdir()) == []  # nothing was written next to it either


def test_bench_attention_kv_heads(lmsys):
    """--kv-heads: k and v with fewer heads, every implementation runs them (naive repeats, SDPA enable_gqa)."""
    r = lmsys("bench", "attention", "--device", "cpu", "--impl", "naive,sdpa,flash-torch", "--heads", "4",
              "--kv-heads", "1", "--d-head", "80", "--seq-len", "24", "--warmup", "0", "--steps", "1",
              "--causal", "--format", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert "kv heads 1" in doc["meta"]["run"]
    assert [row["status"] for row in doc["rows"]] == ["ok"] * 3 and all(row["d"] == 80 for row in doc["rows"])


@pytest.mark.parametrize("args,needle", [
    (("--heads", "4,6", "--kv-heads", "4"), "--kv-heads 4 must divide every --heads value (not 6)"),
    (("--heads", "4", "--kv-heads", "0"), "--kv-heads 0 must divide"),
    (("--impl", "flash-triton", "--d-head", "84"), "head dim 84 is not supported"),
])
def test_bench_attention_head_errors(lmsys, args, needle):
    r = lmsys("bench", "attention", "--device", "cpu", "--seq-len", "16", *args)
    assert r.code == 2 and needle in r.err, r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) <= 2


def test_policy_rows_run_flash_triton_under_the_changed_policy(monkeypatch):
    """--policy: one flash-triton row per variant after the default one, each forward and backward
    launched under default_policy() with exactly those fields changed; other impls run once."""
    from lmsys.kernels import flash as ft

    seen = []
    forward, backward = ft.launch_forward, ft.launch_backward

    def spy_forward(*args, policy=None, **kwargs):
        seen.append(("fwd", policy))
        return forward(*args, policy=policy, **kwargs)

    def spy_backward(*args, policy=None, **kwargs):
        seen.append(("bwd", policy))
        return backward(*args, policy=policy, **kwargs)

    monkeypatch.setattr(ft, "launch_forward", spy_forward)
    monkeypatch.setattr(ft, "launch_backward", spy_backward)
    cpu = torch.device("cpu")
    sweep, _ = bench_attention.resolve_sweep(
        device=cpu, impls=["naive", "flash-triton"], batch=[1], heads=[2], d_head=[16], seq_len=[24], causal=True,
        warmup=0, steps=1, policies=["persistent=true", "deterministic=false,tma=yes"])
    assert sweep.size == 4
    rows = list(bench_attention.run_attention(sweep, device=cpu))
    assert [(r["impl"], r["policy"]) for r in rows] == [
        ("naive", None), ("flash-triton", "default"), ("flash-triton", "persistent=True"),
        ("flash-triton", "deterministic=False,tma=True")]
    assert list(rows[0])[:3] == ["impl", "policy", "batch"] and all(r["status"] == "ok" for r in rows)
    default = ft.default_policy()
    fields = ("persistent", "deterministic", "tma", "tma_backward", "gluon")
    expected = [{f: getattr(default, f) for f in fields} for _ in range(3)]
    expected[1]["persistent"] = True
    expected[2].update(deterministic=False, tma=True)
    # per variant: the checked first step, the memory step, one timed step and one host-µs call
    # (min(HOST_CALLS, steps)), each a forward and a backward
    per_variant = [seen[i:i + 8] for i in range(0, len(seen), 8)]
    assert len(seen) == 24
    for calls, want in zip(per_variant, expected):
        assert [kind for kind, _ in calls] == ["fwd", "bwd"] * 4
        assert all({f: getattr(p, f) for f in fields} == want for _, p in calls)
    for r in rows:
        flops = attention_flops(batch=1, heads=2, n_queries=24, n_keys=24, d_head=16, causal=True,
                                direction="fwd+bwd")
        assert r["fwd+bwd TFLOP/s"] == pytest.approx(flops / (r["fwd+bwd ms"].mean * 1e-3) / 1e12)


def test_policy_values_are_typed_from_the_dataclass_fields(monkeypatch):
    from dataclasses import dataclass

    from lmsys.kernels import flash as ft

    variants = bench_attention.policy_variants(["pick=3,deterministic=none", "tma=off", "gluon=no,tma=1,gluon=on"])
    assert variants == (("pick=3,deterministic=None", (("pick", 3), ("deterministic", None))),
                        ("tma=False", (("tma", False),)), ("gluon=True,tma=True", (("gluon", True), ("tma", True))))

    @dataclass(frozen=True)
    class Policy:  # fields a later Policy may have: whatever they are, the option takes them
        tma: bool = False
        gluon_bwd_min_keys: int = 4096
        gluon_copy_min_keys: dict | None = None
        configs: dict | None = None

    monkeypatch.setattr(ft, "Policy", Policy)
    ((label, changes),) = bench_attention.policy_variants(["gluon_copy_min_keys={128: 8192, 64: 4096},"
                                                          "gluon_bwd_min_keys=1024,tma=1"])
    assert dict(changes) == {"gluon_copy_min_keys": {128: 8192, 64: 4096}, "gluon_bwd_min_keys": 1024, "tma": True}
    for text, needle in [("gluon_bwd_min_keys=many", "not a value of gluon_bwd_min_keys (int)"),
                         ("gluon_copy_min_keys=[1]", "not a value of gluon_copy_min_keys (dict | none)"),
                         ("configs={}", "'configs' is not a lever"), ("persistent=true", "one of: tma, gluon_bwd")]:
        with pytest.raises(LmsysError, match=re.escape(needle)):
            bench_attention.policy_variants([text])


@pytest.mark.parametrize("args,needle", [
    (("--impl", "flash-triton", "--policy", "tma"), "--policy: expected FIELD=VALUE[,FIELD=VALUE...], got 'tma'"),
    (("--impl", "flash-triton", "--policy", "tma=true,"), "expected FIELD=VALUE"),
    (("--impl", "flash-triton", "--policy", "bogus=1"), "'bogus' is not a lever of flash_triton.Policy"),
    (("--impl", "flash-triton", "--policy", "tma=maybe"), "--policy tma=maybe: not a value of tma (bool)"),
    (("--impl", "naive", "--policy", "tma=true"), "--policy changes how flash-triton runs: add --impl flash-triton"),
])
def test_bench_attention_policy_errors(lmsys, args, needle):
    r = lmsys("bench", "attention", "--device", "cpu", "--seq-len", "16", *args)
    assert r.code == 2 and needle in r.err, r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) <= 2


def test_bench_attention_policy_end_to_end(lmsys):
    r = lmsys("bench", "attention", "--device", "cpu", "--impl", "flash-triton", "--policy", "persistent=true",
              "--d-head", "16", "--seq-len", "20", "--heads", "2", "--warmup", "0", "--steps", "1", "--format", "json")
    assert r.code == 0, r.err
    rows = _rows(r.out)
    assert [(row["policy"], row["seq"], row["status"]) for row in rows] == [("default", 20, "ok"),
                                                                          ("persistent=True", 20, "ok")]
    assert all(row["fwd+bwd ms"]["mean"] > 0 for row in rows)
