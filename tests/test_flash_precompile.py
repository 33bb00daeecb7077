"""The backward's kernels compiled in the background on the first forward of a shape class (issue 26 item 8):
nothing under the interpreter; with stand-in kernels, the compiles started are those of exactly what the
real backward then launches (arguments, constants, config), once per class; the switch and the pool."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from lmsys.kernels import flash, flash_triton, precompile, tuning
from lmsys.kernels.flash_triton import _config


class _Kernel:
    """A JITFunction stand-in: `warmup` and launches recorded as (how, name, arguments) with tensors reduced
    to what Triton specializes on (dtype, 16-byte alignment) and what reaches the kernel (shape, strides)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def warmup(self, *args, grid, **kwargs):
        self.log.append(("compile", self.name, _seen(args, kwargs, grid)))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(("launch", self.name, _seen(args, kwargs, grid)))


def _seen(args, kwargs, grid):
    def one(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", x.dtype, tuple(x.shape), x.stride(), x.data_ptr() % 16 == 0)
        return x
    return tuple(map(one, args)), tuple(sorted(kwargs.items())), grid(kwargs) if callable(grid) else grid


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """A compiled Triton pretended (INTERPRET off, CPU tensors), the backward's kernels stand-ins whose
    calls land in the returned log; precompile.start records what it is given (run by the test); an empty
    tuner cache whose timings are faked (1 ms for BLOCK_M 32, else 2) and recorded in log too."""
    log = []
    monkeypatch.setattr(flash_triton, "INTERPRET", False)
    for name in ("_attn_bwd_dq", "_attn_bwd_dkdv", "_attn_bwd_preprocess"):
        monkeypatch.setattr(flash_triton, name, _Kernel(name, log))
    monkeypatch.setattr(flash, "_first_call", lambda: None)  # no driver, no Triton hash here
    monkeypatch.setattr(flash, "_PRECOMPILED", set())
    monkeypatch.setattr(precompile, "allowed", lambda device: True)
    monkeypatch.setattr(precompile, "start", lambda compiles, device: log.append(("start", list(compiles))))
    monkeypatch.setenv("LMSYS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(flash_triton.TUNER, "memory", {})

    def bench(run):
        log.append(("time", run.args[0]))
        return 1.0 if run.args[0].kwargs["BLOCK_M"] == 32 else 2.0

    monkeypatch.setattr(tuning, "bench", bench)
    return log


def _inputs(n=100, heads=4, kv_heads=2, d=16):
    q = torch.randn(1, heads, n, d)
    k, v = (torch.randn(1, kv_heads, n, d) for _ in range(2))
    return q, k, v


def _prepare_then_run(log, q, k, v, policy):
    """Start the precompile (its compiles run here, in order), then the real backward: (compiled, real)."""
    flash_triton._precompile_backward(q, k, v, True, policy)
    starts = [entry for entry in log if entry[0] == "start"]
    assert len(starts) == 1
    log.clear()
    for compile_one in starts[0][1]:
        compile_one()
    compiled = list(log)
    assert not any(entry[0] in ("launch", "time") for entry in compiled)  # nothing runs, nothing is timed
    log.clear()
    o, do = torch.empty_like(q), torch.randn_like(q)  # the forward's o: [Z, H, n, d], contiguous
    lse = torch.empty(q.shape[:-1])
    flash_triton.launch_backward(q, k, v, o, lse, do, True, policy=policy)
    return compiled, list(log)


@pytest.mark.parametrize("mode, kernels", [("two", ["_attn_bwd_dq", "_attn_bwd_dkdv"]), ("fused", ["_attn_bwd_dkdv"]),
                                           ("atomic", ["_attn_bwd_preprocess", "_attn_bwd_dkdv"])])
def test_the_precompile_compiles_what_the_backward_launches(compiled, mode, kernels):
    """The two atomics-free kernels (dQ, dK/dV), the fused one (a host-bound call's: dK/dV with the dQ
    programs), or the atomic path's preprocess and dK/dV: the same arguments, constants, config and grid as
    the real launches, with stand-ins for o, L, dO and the outputs."""
    policy = replace(flash_triton.default_policy(), gluon=False, deterministic=False if mode == "atomic" else None,
                     fused_backward=False if mode == "two" else None)  # _inputs() is host-bound
    prepared, real = _prepare_then_run(compiled, *_inputs(), policy)
    launches = [(name, seen) for how, name, seen in real if how == "launch"]
    assert [(name, seen) for _, name, seen in prepared] == launches
    assert [name for name, _ in launches] == kernels
    dkdv = dict(launches[-1][1][1])
    assert dkdv["ATOMIC_DQ"] is (mode == "atomic") and dkdv["WITH_DQ"] is (mode == "fused")
    assert dkdv["BLOCK_M"] == 16 and dkdv["BLOCK_N"] == 32


def test_a_class_the_tuner_would_time_compiles_its_shortlist_untimed(compiled, monkeypatch):
    """Where the tuner times (two candidates, no stored choice), the precompile compiles both and times
    neither; the real call then times them (on its thread) and launches the faster, one of those compiled.
    Where the choice is known (on disk), only that one is compiled."""
    monkeypatch.setitem(flash_triton.CONFIGS, "dq", [_config(16, 16, 4, 1), _config(32, 16, 4, 1)])
    policy = replace(flash_triton.default_policy(), gluon=False, deterministic=True, fused_backward=False)
    q, k, v = _inputs()
    prepared, real = _prepare_then_run(compiled, q, k, v, policy)
    dq_prepared = [seen for _, name, seen in prepared if name == "_attn_bwd_dq"]
    assert len(dq_prepared) == 2
    assert [entry[1].kwargs["BLOCK_M"] for entry in real if entry[0] == "time"] == [16, 32]
    (dq_launch,) = [e[2] for e in real if e[0] == "launch" and e[1] == "_attn_bwd_dq"]
    assert dict(dq_launch[1])["BLOCK_M"] == 32 and dq_launch in dq_prepared
    assert sorted(map(repr, dq_prepared)) == sorted(repr(e[2]) for e in real
                                                    if e[0] == "compile" and e[1] == "_attn_bwd_dq")

    monkeypatch.setattr(flash_triton.TUNER, "memory", {})  # a new process: the choice is on disk
    monkeypatch.setattr(flash, "_PRECOMPILED", set())
    compiled.clear()
    prepared, real = _prepare_then_run(compiled, q, k, v, policy)
    assert [dict(seen[1])["BLOCK_M"] for _, name, seen in prepared if name == "_attn_bwd_dq"] == [32]
    assert not any(entry[0] == "time" for entry in real)


def test_once_per_shape_class(compiled):
    policy = replace(flash_triton.default_policy(), gluon=False)
    q, k, v = _inputs()
    for _ in range(3):
        flash_triton._precompile_backward(q, k, v, True, policy)
    assert [entry[0] for entry in compiled] == ["start"]
    flash_triton._precompile_backward(q, k, v, False, policy)  # not causal: another class
    flash_triton._precompile_backward(*_inputs(n=120), True, policy)  # another length
    flash_triton._precompile_backward(q, k, v, True, replace(policy, deterministic=False))
    assert [entry[0] for entry in compiled] == ["start"] * 4


def test_the_gluon_backward_is_precompiled_with_its_own_arguments(compiled, monkeypatch):
    """Where the Gluon one launch runs, its kernels' warmups are what flash_gluon.backward would launch
    (the stand-in gluon module receives `prepare`), after the preprocess; no dQ zeroing, no copies run."""
    calls = []

    class Gluon:
        @staticmethod
        def usable_backward(q4, k4, v4, do4, config=None, layout=True):
            return layout is False or all(x.is_contiguous() for x in (q4, k4, v4, do4))

        @staticmethod
        def backward(q4, k4, v4, do4, lse, delta, dq32, dq4, dk4, dv4, is_causal, prepare=None, heads_fast=True):
            calls.append((prepare is not None, _seen((q4, k4, v4, do4, lse, delta, dq32, dq4, dk4, dv4), {}, ())))
            if prepare is not None:
                prepare.append(lambda: calls.append("compiled"))
            return "fake"

    monkeypatch.setattr(flash, "_gluon", lambda: Gluon)
    policy = replace(flash_triton.default_policy(), deterministic=False, host_bound_flops=0)
    q, k, v = _inputs(n=128, heads=2, d=64)
    k = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # strided: copied for the one launch
    prepared, real = _prepare_then_run(compiled, q, k, v, policy)
    assert [name for _, name, _ in prepared] == ["_attn_bwd_preprocess"] and "compiled" in calls
    assert [(how, name) for how, name, _ in real] == [("launch", "_attn_bwd_preprocess")]
    assert prepared[0][2] == real[0][2]
    (prepare_call,) = [c for c in calls if c != "compiled" and c[0]]
    (real_call,) = [c for c in calls if c != "compiled" and not c[0]]
    assert prepare_call[1] == real_call[1]


def test_nothing_is_scheduled_under_the_interpreter(monkeypatch):
    """The real path on CPU tensors through Triton's interpreter: no background work at all."""
    assert flash_triton.INTERPRET
    started = []
    monkeypatch.setattr(precompile, "start", lambda *args: started.append(args))
    monkeypatch.setattr(precompile, "driver_in_background", lambda: started.append("driver"))
    q, k, v = (x.requires_grad_() for x in _inputs(n=40, heads=2, kv_heads=2))
    flash_triton.FlashAttentionTriton.apply(q, k, v, True).sum().backward()
    assert started == [] and not precompile._inflight and q.grad is not None


def test_the_switch_and_where_nothing_may_start(monkeypatch):
    """LMSYS_PRECOMPILE_BACKWARD=0, a CPU device, torch.compile's tracing, a CUDA graph capture: no."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv(precompile.ENV, raising=False)
    assert precompile.allowed(cuda) and not precompile.allowed(torch.device("cpu"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not precompile.allowed(cuda)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not precompile.allowed(cuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv(precompile.ENV, "0")
    assert not precompile.allowed(cuda) and precompile.driver_in_background() is None


def test_the_pool_compiles_in_async_mode_then_finalizes_and_builds_launchers(monkeypatch):
    """A job's compiles run with Triton's async compile mode active on the job's thread and the compiles on
    the pool's; wait_all returns once they are finalized (in Triton's kernel cache) and their launchers
    built; a compile that fails is dropped there and the others go on."""
    from triton.runtime import _async_compile

    pytest.importorskip("triton.runtime._async_compile")
    events, lock = [], threading.Lock()
    monkeypatch.setattr(precompile, "_build_launcher", lambda kernel: events.append(("launcher", kernel)))

    def compile_one(name):
        def compile_fn():
            with lock:
                events.append(("compile", name, threading.current_thread().name))
            return name

        def finalize(kernel):
            events.append(("finalized", kernel))

        mode = _async_compile.active_mode.get()
        assert mode is not None and threading.current_thread().name.startswith("lmsys-precompile")
        try:
            return mode.submit(name, compile_fn, finalize, lambda future_kernel: None)  # triton >= 3.7
        except TypeError:
            return mode.submit(name, compile_fn, finalize)  # triton 3.6

    def fails():
        raise RuntimeError("ptxas failed")

    job = precompile.start([lambda: compile_one("a"), fails, lambda: compile_one("b")], torch.device("cpu"))
    precompile.wait_all()
    assert job.done() and not precompile._inflight
    assert {e[1] for e in events if e[0] == "compile"} == {"a", "b"}
    assert all(e[2].startswith("lmsys-compile") for e in events if e[0] == "compile")
    assert sorted(e[1] for e in events if e[0] == "finalized") == ["a", "b"]
    assert sorted(e[1] for e in events if e[0] == "launcher") == ["a", "b"]
