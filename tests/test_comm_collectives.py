"""`lmsys comm all-gather|reduce-scatter|broadcast|send-recv` (and all-reduce): result checks that pass on the real
collective and catch a wrong one, nccl-tests' busbw factors, the commands end to end (gloo)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmsys.distributed import launch
from lmsys.bench.comm import COLLECTIVES

TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(autouse=True)
def not_under_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def checks_job(ctx):
    """On every rank: each collective's check on the real op and on injected wrong results, and one
    measured row; rank 0 returns them."""
    import torch

    from lmsys.bench import comm as C

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


def send_recv_job(ctx):
    """On every rank: send-recv's check on the real exchange and on wrong ones, and measured rows."""
    import torch

    from lmsys.bench import comm as C

    numel = 13
    bufs = C.make_buffers("send-recv", numel=numel, world_size=ctx.world_size, dtype=torch.float32,
                          device=ctx.device, rank=ctx.rank)
    real = C.check_result(ctx, bufs, run=lambda: C.OPS["batch_isend_irecv"](bufs))
    fallback = C.check_result(ctx, bufs, run=lambda: C.OPS["isend + irecv"](bufs))
    received = bufs.out.tolist()

    def send_only_one_way():  # rank 0 never receives: its output keeps the -1 fill
        if ctx.rank % 2:
            bufs.out.copy_(bufs.inp)
            import torch.distributed as dist
            dist.send(bufs.inp, bufs.peer)
        else:
            import torch.distributed as dist
            dist.recv(bufs.out, bufs.peer)
            bufs.out.fill_(-1)

    def keep_own_input():  # a copy instead of an exchange
        bufs.out.copy_(bufs.inp)

    injected = [C.check_result(ctx, bufs, run=f) for f in (send_only_one_way, keep_own_input)]
    rows = C.measure_collective(ctx, "send-recv", nbytes=4 * numel + 3, label="x", dtype="fp32", warmup=1,
                                iters=2, baseline=True)
    return {"real": real, "fallback": fallback, "received": received, "injected": injected, "rows": rows}


def subgroup_job(ctx):
    """The flat primitives on a group of ranks 0 and 1 only (rank 2 sits out): every call must run on the
    group it is given, not on the world."""
    import torch
    import torch.distributed as dist

    from lmsys.distributed import primitives as P

    group = dist.new_group([0, 1])  # every rank creates it; only its members use it
    if ctx.rank > 1:
        return None
    k = 5
    mine = torch.arange(k, dtype=torch.float32) + 10 * ctx.rank
    gathered = torch.full((2 * k,), -1.0)
    P.all_gather_flat(gathered, mine, group=group)
    a, b = torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.rank)), torch.ones(7) * (ctx.rank + 1)
    summed = P.all_reduce_flat([a, b], group=group)
    try:
        part = torch.full((k,), -1.0)
        P.reduce_scatter_flat(part, torch.arange(2 * k, dtype=torch.float32) * (ctx.rank + 1), group=group)
    except (RuntimeError, NotImplementedError, ValueError):  # gloo without reduce_scatter on this torch
        part = None
    module = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(module.weight, float(ctx.rank + 1))
    P.broadcast_module_state(module, src=1, group=group)
    return {"gathered": gathered.tolist(), "summed": [t.tolist() for t in summed],
            "part": None if part is None else part.tolist(), "weight": module.weight.flatten().tolist()}


@pytest.fixture
def job_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv(launch.ENV_TIMEOUT, "60")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_checks_pass_on_the_real_collective_and_catch_wrong_results(job_env, world):
    from lmsys.bench.comm import bus_factor

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


@pytest.mark.slow
def test_send_recv_exchanges_between_pairs_and_its_check_catches_wrong_results(job_env):
    r = launch.run("test_comm_collectives:send_recv_job", {}, world_size=2, backend="gloo")
    assert r["real"] is True and r["fallback"] is True
    assert r["received"] == [i % 5 + 1 for i in range(13)]  # rank 0 holds rank 1's pattern
    assert r["injected"] == [False, False]
    per_round, bare = r["rows"]
    assert per_round["correct"] is True and per_round["op"] == "batch_isend_irecv"
    assert bare["timing"] == "bare loop" and per_round["bytes"] == 4 * 13  # one rank's send, whole elements
    for row in r["rows"]:
        algbw = row["bytes"] / (row["median ms"] * 1e-3) / 1e9
        assert row["algbw GB/s"] == pytest.approx(algbw) and row["busbw GB/s"] == pytest.approx(algbw)


def test_send_recv_pairs_neighbours():
    from lmsys.bench.comm import send_recv_peer

    assert [send_recv_peer(r) for r in range(6)] == [1, 0, 3, 2, 5, 4]


@pytest.mark.slow
def test_primitives_run_on_the_group_they_are_given(job_env):
    import torch

    r = launch.run("test_comm_collectives:subgroup_job", {}, world_size=3, backend="gloo")
    assert r["gathered"] == list(range(5)) + [10.0 + i for i in range(5)]  # rank 0's part, then rank 1's
    a = sum(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)).double() for rank in (0, 1))
    assert torch.allclose(torch.tensor(r["summed"][0], dtype=torch.float64), a)  # shaped like the input
    assert r["summed"][1] == [3.0] * 7  # 1 + 2 from ranks 0 and 1, not 1 + 2 + 3
    if r["part"] is not None:  # rank 0 keeps elements 0..4 of sum_r (r + 1)·arange(10) = 3·arange(10)
        assert r["part"] == [3.0 * i for i in range(5)]
    assert r["weight"] == [2.0] * 6  # rank 1's values (src is a global rank)


def test_bus_factors_are_nccl_tests():
    from lmsys.bench.comm import bus_factor

    for n in (1, 2, 3, 8):
        assert bus_factor("all-reduce", n) == pytest.approx(2 * (n - 1) / n)
        assert bus_factor("all-gather", n) == pytest.approx((n - 1) / n)
        assert bus_factor("reduce-scatter", n) == pytest.approx((n - 1) / n)
        assert bus_factor("broadcast", n) == 1.0
        assert bus_factor("send-recv", n) == 1.0  # sendrecv_perf: busbw = algbw
    with pytest.raises(ValueError):
        bus_factor("all-to-all", 2)


def test_notes_print_the_factor_the_rows_use():
    from lmsys.bench.comm import BUS_FACTORS, collective_notes

    for name, (formula, _) in BUS_FACTORS.items():
        assert f"busbw = algbw · {formula} " in collective_notes(name, baseline=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize("command, world, factor", [
    ("all-gather", 3, 2 / 3), ("reduce-scatter", 2, 1 / 2), ("broadcast", 2, 1.0), ("all-reduce", 2, 1.0),
    ("sendrecv", 2, 1.0)])
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
    assert r.code == 2 and "--iters must be >= 1" in r.err  # named as typed


def test_send_recv_is_listed_and_refuses_an_odd_world_before_launch(lmsys):
    r = lmsys("comm", "--help")
    assert "│ send-recv " in r.out and "│ sendrecv " not in r.out
    r = lmsys("comm", "send-recv", "--world-size", "2,3")
    assert r.code == 2 and "every world size must be even, got 3" in r.err.splitlines()[0]


@pytest.mark.parametrize("command", ["all-gather", "reduce-scatter", "broadcast", "send-recv"])
@pytest.mark.parametrize("args, message", [
    (["--backend", "nccl"], "--backend nccl needs CUDA GPUs"),
    (["--sizes", "1XB"], "--sizes: cannot parse '1XB'"),
    (["--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["--dtype", "fp64"], "--dtype must be one of"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
])
def test_bad_input_exits_2_with_one_line(lmsys, command, args, message):
    r = lmsys("comm", command, *args)
    assert r.code == 2 and message in r.err.splitlines()[0] and "Traceback" not in r.err
