"""`lmsys comm all-gather|reduce-scatter|broadcast` (and all-reduce): result checks that pass on the real
collective and catch a wrong one, nccl-tests' busbw factors, the commands end to end (gloo)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmsys.distributed import launch
from lmsys.distributed.collectives import COLLECTIVES

TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(autouse=True)
def not_under_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def checks_job(ctx):
    """On every rank: each collective's check on the real op and on injected wrong results, and one
    measured row; rank 0 returns them."""
    import torch

    from lmsys.distributed import collectives as C

    out = {}
    for name in COLLECTIVES:
        n = ctx.world_size
        numel = 7 * n  # an awkward per-rank part
        bufs = C.make_buffers(name, numel=numel, world_size=n, dtype=torch.float32, device=ctx.device)
        op = next(C.OPS[o] for o in C.CANDIDATES[name])
        real = C.check_result(ctx, bufs, run=lambda: op(bufs))

        def corrupt_one_element_on_last_rank():
            op(bufs)
            if ctx.rank == n - 1:
                bufs.out[-1] += 1

        def skip_the_collective():  # the buffers keep this rank's own input (or the -1 fill)
            pass

        def the_wrong_collective():  # e.g. a broadcast where an all-reduce was due, or vice versa
            other = {"all-reduce": "broadcast", "broadcast": "all-reduce"}.get(name)
            if other is None:  # all-gather / reduce-scatter: the parts in the wrong rank order
                op(bufs)
                bufs.out.copy_(bufs.out.flip(0))
            else:
                C.OPS[C.CANDIDATES[other][0]](bufs)

        injected = [C.check_result(ctx, bufs, run=f)
                    for f in (corrupt_one_element_on_last_rank, skip_the_collective, the_wrong_collective)]
        rows = C.measure_collective(ctx, name, nbytes=4 * numel + 3, label="x", dtype="fp32", warmup=1, iters=2,
                                    baseline=True)
        out[name] = {"real": real, "injected": injected, "rows": rows}
    return out


@pytest.fixture
def job_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv(launch.ENV_TIMEOUT, "60")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_checks_pass_on_the_real_collective_and_catch_wrong_results(job_env, world):
    from lmsys.distributed.collectives import bus_factor

    results = launch.run("test_comm_collectives:checks_job", {}, world_size=world, backend="gloo")
    for name in COLLECTIVES:
        r = results[name]
        assert r["real"] is True, name
        assert r["injected"] == [False, False, False], name
        per_round, bare = r["rows"]
        assert per_round["correct"] is True and bare["timing"] == "bare loop"
        assert per_round["bytes"] == 4 * 7 * world  # the full buffer, whole elements, a multiple of n
        assert per_round["op"] and per_round["op"] != "unsupported"
        for row in r["rows"]:
            algbw = row["bytes"] / (row["median ms"] * 1e-3) / 1e9
            assert row["algbw GB/s"] == pytest.approx(algbw)
            assert row["busbw GB/s"] == pytest.approx(algbw * bus_factor(name, world))


def test_bus_factors_are_nccl_tests():
    from lmsys.distributed.collectives import bus_factor

    for n in (1, 2, 3, 8):
        assert bus_factor("all-reduce", n) == pytest.approx(2 * (n - 1) / n)
        assert bus_factor("all-gather", n) == pytest.approx((n - 1) / n)
        assert bus_factor("reduce-scatter", n) == pytest.approx((n - 1) / n)
        assert bus_factor("broadcast", n) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("command, world, factor", [
    ("all-gather", 3, 2 / 3), ("reduce-scatter", 2, 1 / 2), ("broadcast", 2, 1.0), ("all-reduce", 2, 1.0)])
def test_command_end_to_end(lmsys, monkeypatch, command, world, factor):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    r = lmsys("comm", command, "--backend", "gloo", "--world-size", str(world), "--sizes", "1KB,10000",
              "--warmup", "1", "--iters", "2", "--format", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    rows = doc["rows"]
    assert [row["size"] for row in rows] == ["1KB", "10000"]
    for row in rows:
        assert row["correct"] is True and row["world size"] == world
        assert row["bytes"] % (4 * world) == 0 and row["bytes"] <= {"1KB": 1000, "10000": 10000}[row["size"]]
        assert row["busbw GB/s"] == pytest.approx(row["algbw GB/s"] * factor)


def test_all_reduce_alias_is_hidden_but_works(lmsys):
    r = lmsys("comm", "--help")
    assert "all-gather" in r.out and "reduce-scatter" in r.out and "broadcast" in r.out
    assert "│ all-reduce " not in r.out and "│ allreduce " in r.out  # listed once, as allreduce
    r = lmsys("comm", "all-reduce", "--iters", "0")
    assert r.code == 2 and "--steps must be >= 1" in r.err


@pytest.mark.parametrize("command", ["all-gather", "reduce-scatter", "broadcast"])
@pytest.mark.parametrize("args, message", [
    (["--backend", "nccl"], "--backend nccl needs CUDA GPUs"),
    (["--sizes", "1XB"], "cannot parse size '1XB'"),
    (["--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["--dtype", "fp64"], "--dtype must be one of"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
])
def test_bad_input_exits_2_with_one_line(lmsys, command, args, message):
    r = lmsys("comm", command, *args)
    assert r.code == 2 and message in r.err.splitlines()[0] and "Traceback" not in r.err
