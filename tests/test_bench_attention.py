"""`lmsys bench attention` through the real CLI entry point and its library (lmsys.bench.attention)."""

from __future__ import annotations

import json

import pytest
import torch

from lmsys.bench import attention as bench_attention
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


def test_bench_attention_cpu_defaults_are_small(lmsys, monkeypatch):
    seen = []

    def fake_measure(impl, batch, heads, d, seq, sweep, device):
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

    def fake_measure(impl, batch, heads, d, seq, sweep, device):
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


@pytest.mark.parametrize("args,needle", [
    (("--impl", "flashy"), "attention implementation must be one of"),
    (("--preset", "fast"), "--preset must be one of leaderboard"),
    (("--seq-len", "0"), "--context-length"),  # --seq-len is the old spelling
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
