"""`lmsys comm allreduce`: end to end through torchrun (gloo), under a user's torchrun, error paths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(autouse=True)
def not_under_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
def test_allreduce_end_to_end_through_torchrun(lmsys, tmp_path):
    out = tmp_path / "allreduce.json"
    r = lmsys("comm", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "1KB,1MiB",
              "--warmup", "1", "--iters", "3", "--baseline", "--format", "json", "--output", str(out))
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert json.loads(out.read_text()) == doc
    rows = doc["rows"]
    assert [(row["size"], row["timing"]) for row in rows] == [
        ("1KB", "per-round"), ("1KB", "bare loop"), ("1MiB", "per-round"), ("1MiB", "bare loop")]
    for row in rows:
        assert row["backend"] == "gloo" and row["world size"] == 2 and row["dtype"] == "fp32"
        assert row["bytes"] == {"1KB": 1000, "1MiB": 2**20}[row["size"]]
        assert row["median ms"] > 0 and row["mean ms"] > 0
        algbw = row["bytes"] / (row["median ms"] * 1e-3) / 1e9
        assert row["algbw GB/s"] == pytest.approx(algbw)
        assert row["busbw GB/s"] == pytest.approx(algbw * 2 * (2 - 1) / 2)  # nccl-tests: 2(n-1)/n
    assert [row["correct"] for row in rows if row["timing"] == "per-round"] == [True, True]
    assert {row["op"] for row in rows} == {"all_reduce"}
    assert "torch" in doc["meta"] and "run" in doc["meta"]


@pytest.mark.slow
def test_allreduce_three_ranks_bf16_sum_is_exact(lmsys):
    r = lmsys("comm", "allreduce", "--world-size", "3", "--sizes", "3000", "--dtype", "bf16",
              "--warmup", "0", "--iters", "2", "--format", "json")
    assert r.code == 0, r.err
    (row,) = json.loads(r.out)["rows"]
    assert row["correct"] is True and row["bytes"] == 3000
    assert row["busbw GB/s"] == pytest.approx(row["algbw GB/s"] * 2 * 2 / 3)


@pytest.mark.slow
def test_under_a_users_torchrun_only_rank0_prints(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "lmsys", "comm", "allreduce", "--sizes", "4KB", "--warmup", "0", "--iters", "2",
           "--format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # exactly one document: the other rank printed nothing
    (row,) = doc["rows"]
    assert row["world size"] == 2 and row["correct"] is True


@pytest.mark.parametrize("args, message", [
    (["--backend", "nccl"], "--backend nccl needs CUDA GPUs"),
    (["--backend", "mpi"], "--backend must be one of gloo, nccl"),
    (["--sizes", "1XB"], "--sizes: cannot parse '1XB'"),
    (["--sizes", "0MB"], "--sizes must be >= 1 byte, got '0MB'"),
    (["--world-size", "two"], "--world-size: cannot parse 'two'"),
    (["--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["--dtype", "fp64"], "--dtype must be one of"),
    (["--iters", "0"], "--iters must be >= 1, got 0"),  # named as typed
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--format", "xml"], "--format must be one of"),
])
def test_bad_input_exits_2_with_one_line(lmsys, args, message):
    r = lmsys("comm", "allreduce", *args)
    assert r.code == 2
    assert r.err.splitlines()[0].startswith("error: ") and message in r.err.splitlines()[0]
    assert "Traceback" not in r.err and len(r.err.splitlines()) <= 2  # the error and maybe a hint


def test_world_size_larger_than_visible_gpus(lmsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    r = lmsys("comm", "allreduce", "--backend", "nccl", "--world-size", "2")
    assert r.code == 2 and "needs 2 GPUs; 1 visible" in r.err


def test_world_size_must_match_torchrun(lmsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    r = lmsys("comm", "allreduce", "--backend", "gloo", "--world-size", "2")
    assert r.code == 2 and "WORLD_SIZE=4" in r.err


def test_a_failed_rank_exits_1_with_its_error(lmsys, monkeypatch):
    from lmsys.distributed import launch

    def failing_run(*args, **kwargs):
        raise launch.RankFailedError("rank 1 failed: RuntimeError: boom", rank=1)

    monkeypatch.setattr(launch, "run", failing_run)
    r = lmsys("comm", "allreduce", "--backend", "gloo", "--sizes", "1KB")
    assert r.code == 1 and r.err.strip() == "error: rank 1 failed: RuntimeError: boom"
