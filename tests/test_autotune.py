"""lmsys.kernels.tuning and flash_triton's use of it: shape classes, the shortlist, the disk file. Timing is
faked (tuning.bench replaced: each config gets a fixed time), so these run on the CPU without timing
anything; the kernels run under Triton's interpreter where a launch is checked."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lmsys.kernels import flash_triton, plans, tuning
from lmsys.kernels.flash_triton import _config

FAST, SLOW = _config(32, 16, 4, 1), _config(16, 16, 4, 1)


@pytest.fixture
def timer(monkeypatch, tmp_path):
    """tuning.bench faked: the config each call times, recorded; 1 ms for BLOCK_M 32, else 2 ms. An empty
    cache dir and no choices in memory."""
    timed = []

    def bench(run):
        config = run.args[0]
        timed.append(config)
        return 1.0 if config.kwargs["BLOCK_M"] == 32 else 2.0

    monkeypatch.setenv("LMSYS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "bench", bench)
    monkeypatch.setattr(flash_triton.TUNER, "memory", {})
    return timed


def _tuner(**stamp):
    return tuning.Tuner("t", lambda: {"torch": "1", "triton": "2", "source": "abc", **stamp})


def _never(config):
    raise AssertionError("the tuner's fake bench does not run configs")


def test_bucket_and_cache_dir(monkeypatch, tmp_path):
    assert [tuning.bucket(n, floor=64, cap=16384) for n in (1, 63, 64, 100, 4096, 4100, 8191, 8192, 10**6)] == \
        [64, 64, 64, 64, 4096, 4096, 4096, 8192, 16384]
    monkeypatch.setenv("LMSYS_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert tuning.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LMSYS_CACHE_DIR")
    assert tuning.cache_dir() == tmp_path / "x" / "lmsys"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert tuning.cache_dir() == tmp_path / "h" / ".cache" / "lmsys"


def test_tuner_times_once_then_reads_memory_then_disk(timer):
    tuner = _tuner()
    assert tuner.choose(("k", 1), [SLOW, FAST], _never) is FAST  # the faster, whatever the order
    assert timer == [SLOW, FAST]
    assert tuner.choose(("k", 1), [SLOW, FAST], _never) is FAST and len(timer) == 2  # memory
    fresh = _tuner()  # a new process: nothing in memory, the file is read
    assert fresh.choose(("k", 1), [SLOW, FAST], _never) is FAST and len(timer) == 2
    data = json.loads(fresh.path().read_text())
    assert data["entries"] == {"k|1": tuning.config_json(FAST)} and data["stamp"]["source"] == "abc"
    assert fresh.choose(("k", 2), [SLOW, FAST], _never) is FAST and len(timer) == 4  # another key times
    assert set(json.loads(fresh.path().read_text())["entries"]) == {"k|1", "k|2"}
    assert not [p for p in fresh.path().parent.iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("stamp", [{"source": "abd"}, {"torch": "1.1"}, {"triton": "3"}])
def test_another_source_or_version_misses(timer, stamp):
    _tuner().choose(("k",), [SLOW, FAST], _never)
    other = _tuner(**stamp)
    assert other.path() != _tuner().path()
    assert other.choose(("k",), [SLOW, FAST], _never) is FAST and len(timer) == 4


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '{"stamp": {}, "entries": {}}', "\udcff"])
def test_a_corrupt_file_is_ignored_and_replaced(timer, text):
    tuner = _tuner()
    tuner.path().parent.mkdir(parents=True)
    tuner.path().write_bytes(text.encode("utf-8", "surrogateescape"))
    assert tuner.choose(("k",), [SLOW, FAST], _never) is FAST and len(timer) == 2
    assert json.loads(tuner.path().read_text())["entries"] == {"k": tuning.config_json(FAST)}


def test_a_stored_choice_that_is_no_candidate_retimes(timer):
    _tuner().choose(("k",), [SLOW, FAST], _never)
    other = _config(64, 16, 4, 1)
    assert _tuner().choose(("k",), [SLOW, other], _never) is SLOW and len(timer) == 4


def test_one_candidate_is_not_timed_nor_stored(timer):
    tuner = _tuner()
    assert tuner.choose(("k",), [SLOW], _never) is SLOW
    assert timer == [] and not tuner.path().exists()


def test_a_cache_dir_that_cannot_be_written_keeps_the_choice_in_memory(timer, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LMSYS_CACHE_DIR", str(tmp_path / "file" / "below"))  # a file where a folder goes
    tuner = _tuner()
    assert tuner.choose(("k",), [SLOW, FAST], _never) is FAST
    assert tuner.choose(("k",), [SLOW, FAST], _never) is FAST and len(timer) == 2


# ------------------------------------------------------------------------ flash_triton's shape classes


def _forward(n_q, n_k=None, causal=True, seed=0):
    """launch_forward at [1, 2, n_q, 16] (the tiles it ran), checked against the plain math."""
    torch.manual_seed(seed)
    q = torch.randn(1, 2, n_q, 16)
    k, v = (torch.randn(1, 2, n_k or n_q, 16) for _ in range(2))
    o, _, ran = flash_triton.launch_forward(q, k, v, causal, policy=flash_triton.Policy())
    scores = q @ k.transpose(-1, -2) / 4
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(o, torch.softmax(scores, -1) @ v, atol=1e-4, rtol=1e-4)
    return ran["fwd"]


@pytest.fixture
def three_forward_configs(monkeypatch):
    """Three fitting forward configs: the tuner shortlists two (the first two: the grid is full), and
    SLOW first, so the faster one is the second."""
    monkeypatch.setitem(flash_triton.CONFIGS, "fwd", [SLOW, FAST, _config(16, 32, 4, 1)])


@pytest.mark.skipif(not flash_triton.INTERPRET, reason="CPU tensors through the interpreter (the GPU tests tune for real)")
def test_a_length_in_a_known_class_is_not_timed_again(timer, three_forward_configs):
    assert _forward(100) == "32×16" and timer == [SLOW, FAST]  # two of three configs timed: FAST wins
    assert _forward(127, 70) == "32×16" and len(timer) == 2  # lengths 64..127: the same class
    assert _forward(128) == "32×16" and len(timer) == 4  # 128..255: a new one
    assert _forward(100, causal=False) == "32×16" and len(timer) == 6  # not causal: a new one


@pytest.mark.skipif(not flash_triton.INTERPRET, reason="CPU tensors through the interpreter (the GPU tests tune for real)")
def test_a_new_process_reads_the_disk_and_a_new_source_misses(timer, three_forward_configs, monkeypatch):
    _forward(90)
    monkeypatch.setattr(flash_triton.TUNER, "memory", {})  # a new process
    assert _forward(110) == "32×16" and len(timer) == 2
    entries = json.loads(flash_triton.TUNER.path().read_text())["entries"]
    (key,) = entries
    assert key.startswith("fwd|interpreter|torch.float32|16|True|") and key.endswith("|64|64|2|1")
    monkeypatch.setattr(flash_triton.TUNER, "memory", {})
    monkeypatch.setattr(flash_triton, "_source_digest", lambda: "edited")  # the kernel file changed
    assert _forward(110) == "32×16" and len(timer) == 4


@pytest.mark.skipif(not flash_triton.INTERPRET, reason="CPU tensors through the interpreter (the GPU tests tune for real)")
def test_first_fit_without_autotuning(timer, three_forward_configs, monkeypatch):
    monkeypatch.setenv("LMSYS_FLASH_AUTOTUNE", "0")
    q = torch.randn(1, 2, 50, 16)
    _, _, ran = flash_triton.launch_forward(q, q, q, True, policy=flash_triton.default_policy())
    assert ran == {"fwd": "16×16"} and timer == [] and flash_triton.TUNER.memory == {}


def test_the_source_digest_is_this_files():
    import hashlib

    with open(flash_triton.__file__, "rb") as f:
        assert flash_triton._stamp()["source"] == hashlib.sha256(f.read()).hexdigest()
    assert flash_triton._stamp()["triton"] and flash_triton._stamp()["torch"] == torch.__version__


# ----------------------------------------------------------------------------- the shortlist on a GPU


def _gpu_shortlist(kernel, d, rows, heads, sms=132):
    fitting = flash_triton.fitting_configs(kernel, flash_triton.GPU_CONFIGS[kernel], d_pad=d, elem=2, smem=232448)
    short = flash_triton._shortlist(kernel, fitting, d_pad=d, rows=rows, heads=heads, programs=sms)
    return [flash_triton._tiles(c) for c in short]


def test_gpu_shortlist_holds_the_sweeps_best_at_the_leaderboard_shape():
    """bf16, seq 16384, b1 h16: the best of the H200 sweep (docs/benchmarks/attention.md) is shortlisted
    at d 64 and d 128, two configs at most."""
    best = {64: {"fwd": (128, 64, 8, 3), "dkdv": (64, 64, 4, 3), "dq": (64, 128, 4, 3)},
            128: {"fwd": (128, 64, 8, 3), "dkdv": (64, 128, 8, 3), "dq": (128, 64, 8, 3)}}
    for d, kernels in best.items():
        for kernel, tiles in kernels.items():
            short = _gpu_shortlist(kernel, d, 16384, 16)
            assert short[0] == tiles and len(short) == 2, (d, kernel, short)


def test_gpu_shortlist_takes_smaller_tiles_where_the_grid_leaves_sms_idle():
    assert _gpu_shortlist("fwd", 64, 1024, 16) == [(128, 64, 8, 3), (64, 64, 4, 3)]  # 128 programs < 132
    assert _gpu_shortlist("fwd", 64, 2048, 16) == [(128, 64, 8, 3), (128, 64, 4, 3)]  # 256: full
    assert _gpu_shortlist("dkdv", 128, 512, 8) == [(64, 128, 8, 3), (64, 64, 4, 3)]  # keys' tiles
    assert _gpu_shortlist("dq", 128, 256, 4)[1][0] == 64
    assert all(len(_gpu_shortlist(k, d, n, 1)) <= 2 for k in ("fwd", "dkdv", "dq") for d in (16, 64, 128, 256)
               for n in (64, 4096))


def _fp32_shortlist(kernel, d, rows=8192, heads=8):
    configs = flash_triton.FP32_GPU_CONFIGS[kernel]
    fitting = flash_triton.fitting_configs(kernel, configs, d_pad=d, elem=4, smem=232448)
    short = flash_triton._shortlist(kernel, fitting, d_pad=d, rows=rows, heads=heads, programs=132, fp32=True)
    return [flash_triton._tiles(c) for c in short]


def test_fp32_shortlist_holds_the_h100_sweeps_best():
    """fp32, b8 h1 s8192 (bf16x6 dots, H100: docs/benchmarks/attention.md, "fp32 dots"): the fastest
    config of each kernel that the estimate lets fit is shortlisted, d 128's without d 64's first (its
    tiles do not fit there); the cheapest config is GPU_CONFIGS' cheapest, so the shared-memory check
    (flash._smallest_tiles) says the same for fp32 as before."""
    assert _fp32_shortlist("fwd", 128) == [(128, 64, 8, 1), (64, 64, 4, 1)]  # 4.06 / 4.28 ms
    assert _fp32_shortlist("fwd", 64) == [(128, 64, 8, 3), (128, 64, 8, 1)]  # 2.20 / 2.32
    assert _fp32_shortlist("dq", 128) == [(128, 32, 8, 1), (64, 64, 4, 1)]  # 24.3 / 26.9 (fwd+dq+dkdv)
    assert _fp32_shortlist("dq", 64) == [(128, 64, 8, 3), (128, 32, 8, 1)]
    assert _fp32_shortlist("dkdv", 128) == [(32, 64, 4, 3), (32, 32, 4, 2)]
    for kernel in ("fwd", "dq", "dkdv"):
        for d in (16, 32, 64, 128):
            cost = [flash_triton._cost(kernel, c, d, 4)[1] for c in flash_triton.FP32_GPU_CONFIGS[kernel]]
            assert min(cost) == min(flash_triton._cost(kernel, c, d, 4)[1] for c in flash_triton.GPU_CONFIGS[kernel])


def test_fp32_dots_follow_torchs_matmul_precision(monkeypatch):
    """bf16x6 at "highest" (as accurate as tf32x3), bf16x3 at "high"/"medium", as torch documents the
    setting; tf32x3 where the backend or the GPU has no bf16 splits, off a GPU and under the interpreter."""
    from lmsys.kernels import dots

    monkeypatch.setattr(dots, "INTERPRET", False)
    monkeypatch.setattr(dots, "capability", lambda device: (9, 0))
    monkeypatch.setattr(dots, "_backend_dots", lambda: ("tf32", "tf32x3", "ieee", "bf16x3", "bf16x6"))
    previous = torch.get_float32_matmul_precision()
    try:
        for setting, expected in (("highest", "bf16x6"), ("high", "bf16x3"), ("medium", "bf16x3")):
            torch.set_float32_matmul_precision(setting)
            assert dots.fp32_dots("cuda:0") == expected
            assert dots.dot_precision(torch.zeros(1, device="meta").to(torch.float32)) == "tf32x3"  # not a GPU
        torch.set_float32_matmul_precision("highest")
        assert dots.fp32_dots("cpu") == "tf32x3"
        # torch's newer setting, after which get_float32_matmul_precision() raises: read too
        newer = torch.backends.cuda.matmul.fp32_precision
        try:
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            assert dots.matmul_precision() == "high" and dots.fp32_dots("cuda:0") == "bf16x3"
            assert plans.key(("fwd", False, None), (torch.zeros(2, 8),))  # a plan's key reads it too
        finally:
            torch.backends.cuda.matmul.fp32_precision = newer
        assert dots.matmul_precision() == "highest"
        monkeypatch.setattr(dots, "capability", lambda device: (7, 5))
        assert dots.fp32_dots("cuda:0") == "tf32x3"
        monkeypatch.setattr(dots, "capability", lambda device: (8, 0))
        monkeypatch.setattr(dots, "_backend_dots", lambda: ("tf32", "tf32x3", "ieee"))
        assert dots.fp32_dots("cuda:0") == "tf32x3"
        monkeypatch.setattr(dots, "INTERPRET", True)
        monkeypatch.setattr(dots, "_backend_dots", lambda: ("tf32", "tf32x3", "ieee", "bf16x3", "bf16x6"))
        assert dots.fp32_dots("cuda:0") == "tf32x3"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert flash_triton._dot_precision(torch.zeros(1, dtype=torch.bfloat16)) == "tf32"  # ignored for 16-bit


def test_concurrent_writers_leave_a_whole_file(timer):
    """Two processes that tuned different keys, writing in turn: both choices stay (each writer reads the
    file again first); a reader never sees a torn file (os.replace)."""
    first, second = _tuner(), _tuner()
    first.choose(("a",), [SLOW, FAST], _never)
    second.choose(("b",), [SLOW, FAST], _never)
    assert set(json.loads(first.path().read_text())["entries"]) == {"a", "b"}
    assert sorted(os.listdir(first.path().parent)) == [first.path().name]


def test_a_candidate_that_fails_is_passed_over(timer, monkeypatch):
    """A config that fails to compile or launch (shared memory the estimate missed) is not chosen; when
    every one fails, the error is raised and nothing is stored."""

    def bench(run):
        if run.args[0] is FAST:
            raise RuntimeError("out of resources")
        return 3.0

    monkeypatch.setattr(tuning, "bench", bench)
    tuner = _tuner()
    assert tuner.choose(("k",), [SLOW, FAST], _never) is SLOW
    with pytest.raises(RuntimeError, match="out of resources"):
        tuner.choose(("j",), [FAST, FAST], _never)
    assert set(json.loads(tuner.path().read_text())["entries"]) == {"k"}


def test_candidates_compile_together_before_timing_and_only_then(timer, monkeypatch):
    """The shortlist is compiled inside Triton's async compile mode (threads) before the first timing; a
    compile that fails is left for the timing to pass over; nothing compiles when no timing is needed (one
    candidate, a choice on disk or in memory) or with LMSYS_TUNE_COMPILE_THREADS=0."""
    from triton.runtime import _async_compile

    events = []

    def compile_one(config):
        assert _async_compile.active_mode.get() is not None  # Triton's compiles go to the thread pool
        events.append(("compile", config))
        if config is SLOW:
            raise RuntimeError("ptxas failed")

    tuner = _tuner()
    assert tuner.choose(("k",), [SLOW, FAST], _never, compile_one) is FAST
    assert events == [("compile", SLOW), ("compile", FAST)] and timer == [SLOW, FAST]
    assert _async_compile.active_mode.get() is None
    tuner.memory.clear()
    assert tuner.choose(("k",), [SLOW, FAST], _never, compile_one) is FAST  # from the disk
    assert tuner.choose(("j",), [FAST], _never, compile_one) is FAST  # the only one
    assert len(events) == 2
    monkeypatch.setenv("LMSYS_TUNE_COMPILE_THREADS", "0")
    assert tuner.choose(("i",), [SLOW, FAST], _never, compile_one) is FAST and len(events) == 2


@pytest.fixture
def triton_key(monkeypatch, tmp_path):
    """Triton's hash faked (counted calls) and restored after; an empty cache dir; persist_triton_key's
    once-per-process memory cleared."""
    import triton
    import triton.runtime.cache as cache

    calls = []

    def compute():
        calls.append(1)
        return f"{triton.__version__}-fake-hash"

    monkeypatch.setenv("LMSYS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "triton_key", compute)
    tuning.persist_triton_key.cache_clear()
    yield calls
    tuning.persist_triton_key.cache_clear()


def test_triton_key_is_computed_once_then_read_from_disk(triton_key, monkeypatch):
    import triton.runtime.cache as cache

    tuning.persist_triton_key()
    assert triton_key == [1] and cache.triton_key().endswith("-fake-hash")
    files = list(tuning.cache_dir().glob("triton-key-*.txt"))
    assert len(files) == 1 and files[0].read_text() == cache.triton_key()
    # a new process: Triton's own function again, the file read instead of hashing
    monkeypatch.setattr(cache, "triton_key", lambda: triton_key.append(1) or "never")
    tuning.persist_triton_key.cache_clear()
    tuning.persist_triton_key()
    assert triton_key == [1] and cache.triton_key().endswith("-fake-hash")
    # what Triton's compile path calls sees it
    assert cache.get_cache_key.__globals__["triton_key"]() == cache.triton_key()


@pytest.mark.parametrize("text", ["", "not-this-version"])
def test_a_torn_or_foreign_triton_key_file_is_recomputed(triton_key, text, monkeypatch):
    import triton.runtime.cache as cache

    compute = cache.triton_key
    tuning.persist_triton_key()
    path = next(tuning.cache_dir().glob("triton-key-*.txt"))
    path.write_text(text)
    monkeypatch.setattr(cache, "triton_key", compute)  # a new process
    tuning.persist_triton_key.cache_clear()
    tuning.persist_triton_key()
    assert len(triton_key) == 2 and path.read_text().endswith("-fake-hash")


def test_an_unwritable_cache_dir_still_gives_triton_its_key(triton_key, monkeypatch, tmp_path):
    import triton.runtime.cache as cache

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LMSYS_CACHE_DIR", str(tmp_path / "file" / "cache"))
    tuning.persist_triton_key()
    assert triton_key == [1] and cache.triton_key().endswith("-fake-hash")
