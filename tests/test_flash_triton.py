"""FlashAttentionTriton against float64: in Triton's interpreter on a CPU, compiled on a GPU (`gpu` marker).

Under the interpreter the kernels use one small config (BLOCK_M 32 / BLOCK_N 16 forward, 16/32 for dK/dV,
32/16 for dQ), so inputs of a few dozen rows already span several tiles, partial edge tiles and, when
causal, diagonal tiles whose query and key tiles differ in size.
"""

from __future__ import annotations

import gc
import random
from dataclasses import replace

import pytest
import torch

from lmsys.core.errors import LmsysError
from lmsys.core.flops import attention_flops
from lmsys.kernels import flash, flash_triton
from lmsys.kernels.attention import attention, naive_attention
from lmsys.bench.flash_check import reference_attention, relative_error
from lmsys.kernels.flash_triton import FlashAttentionTriton, flash_forward


def tl_lang():
    import triton.language as tl

    return tl

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(x, ref):
    """Relative error for tensors of magnitude >= 1, absolute below (zero gradients, e.g. one key)."""
    return relative_error(x, ref)


def _run_and_compare(q, k, v, causal, tol, *, deterministic=None, policy=None) -> dict:
    """Forward + backward on DEVICE; O, the saved L and dQ, dK, dV against float64 on the CPU. k and v
    may have fewer heads than q (dim -3): the reference repeats them. Returns what ran (kernel -> tiles)."""
    q_, k_, v_ = (x.detach().to(DEVICE).requires_grad_() for x in (q, k, v))
    out = FlashAttentionTriton.apply(q_, k_, v_, causal, deterministic, policy)
    lse = out.grad_fn.saved_tensors[4]
    do = torch.randn(out.shape).to(q.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), do.to(DEVICE))
    q64, k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = reference_attention(q64, k64, v64, causal)
    refs = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())
    assert out.dtype == q.dtype and dq.dtype == q.dtype and dk.dtype == q.dtype and lse.dtype == torch.float32
    errors = {}
    for name, got, ref in zip(("O", "L", "dQ", "dK", "dV"), (out, lse, dq, dk, dv), (o_ref, lse_ref, *refs)):
        assert got.shape == ref.shape, name
        errors[name] = _rel(got, ref)
    assert all(e < tol for e in errors.values()), {k: f"{e:.2e}" for k, e in errors.items()}
    return flash_triton.kernels_ran(out)


def _inputs(lead, n_q, n_k, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, n_q, d, generator=g).to(dtype)
    k, v = (torch.randn(*lead, n_k, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


# (leading dims, n_q, n_k, d, causal, dtype): every head dim, every dtype, causal and not, n_q != n_k
# both ways, batch 1, one to three leading dims, lengths at, just past and well past the tile sizes.
CASES = [
    ((2,), 37, 53, 16, False, torch.float32),
    ((1, 2), 70, 70, 32, True, torch.float32),
    ((), 45, 29, 64, True, torch.bfloat16),
    ((2, 1, 2), 33, 81, 16, True, torch.float16),
    ((1,), 1, 17, 64, False, torch.float32),
    ((1,), 64, 64, 128, True, torch.bfloat16),
    ((3,), 17, 16, 128, False, torch.float16),
    ((1, 1), 29, 45, 256, True, torch.bfloat16),
    ((1,), 31, 1, 32, False, torch.bfloat16),
    ((2,), 48, 96, 64, True, torch.float32),
]


@pytest.mark.parametrize("lead,n_q,n_k,d,causal,dtype", CASES)
def test_matches_float64(lead, n_q, n_k, d, causal, dtype):
    _run_and_compare(*_inputs(lead, n_q, n_k, d, dtype, seed=n_q * 1000 + n_k), causal, TOL[dtype])


def test_fresh_random_shapes():
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    for _ in range(4):
        causal, dtype = rng.random() < 0.5, rng.choice(list(TOL))
        n_q = rng.randint(1, 80)
        n_k = n_q if causal and rng.random() < 0.5 else rng.randint(1, 80)
        lead, d = rng.choice([(), (1,), (2, 2)]), rng.choice(flash_triton.HEAD_DIMS[:4])
        try:
            _run_and_compare(*_inputs(lead, n_q, n_k, d, dtype, seed=rng.randrange(2**31)), causal, TOL[dtype])
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {lead} {n_q}x{n_k} d{d} {dtype} causal={causal}: {exc}") from None


def _gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, hq, n_q, d, generator=g).to(dtype)
    k, v = (torch.randn(*lead, hkv, n_k, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


# Head dims that are multiples of 8 but not powers of two (padded to the next one inside the kernel, with
# masks), a power of two for contrast, and 256; in every dtype that takes them, causal and not.
PADDED_CASES = [
    ((2,), 37, 53, 80, False, torch.float32),
    ((1,), 45, 29, 40, True, torch.bfloat16),
    ((), 33, 33, 24, True, torch.float16),
    ((1,), 29, 45, 96, True, torch.bfloat16),
    ((1,), 21, 37, 136, False, torch.float16),
    ((1,), 25, 25, 256, True, torch.float16),
]


@pytest.mark.parametrize("lead,n_q,n_k,d,causal,dtype", PADDED_CASES)
def test_padded_head_dims_match_float64(lead, n_q, n_k, d, causal, dtype):
    _run_and_compare(*_inputs(lead, n_q, n_k, d, dtype, seed=d * 7 + n_q), causal, TOL[dtype])


# (leading dims, Hq, Hkv, n_q, n_k, d, causal, dtype): multi-query (Hkv 1), Hkv = Hq/4, Hkv = Hq/2.
GQA_CASES = [
    ((1,), 4, 1, 37, 29, 32, True, torch.float32),
    ((2,), 8, 2, 21, 45, 80, False, torch.bfloat16),
    ((), 4, 2, 33, 33, 16, True, torch.float16),
]


@pytest.mark.parametrize("lead,hq,hkv,n_q,n_k,d,causal,dtype", GQA_CASES)
def test_grouped_query_attention_matches_float64(lead, hq, hkv, n_q, n_k, d, causal, dtype):
    """k, v with fewer heads than q: dK, dV summed over each group, compared with repeated heads in float64."""
    q, k, v = _gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed=hq * 100 + hkv)
    _run_and_compare(q, k, v, causal, TOL[dtype])


@pytest.mark.parametrize("case", [((1,), 4, 1, 37, 29, 80, True, torch.float32),
                                  ((2,), 2, 2, 45, 61, 64, False, torch.bfloat16)])
def test_atomic_backward_matches_float64(case):
    """deterministic=False: one backward launch, dQ accumulated in float32 with atomics."""
    lead, hq, hkv, n_q, n_k, d, causal, dtype = case
    ran = _run_and_compare(*_gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed=n_q), causal, TOL[dtype],
                           deterministic=False, policy=flash_triton.Policy())
    assert set(ran) == {"fwd", "dkdv"}  # no dQ kernel ran


def test_the_preprocess_computes_d_and_zeroes_every_row_of_the_float32_dq_and_nothing_past_it():
    """The one-launch backwards' first launch: D = rowsum(dO ∘ O) against float64, and zeros into the float32
    dQ they add into (a buffer of NaNs here, as a reused allocation may hold), not one element past its end.
    Batch 1, 3 heads, 37 rows (not a multiple of the row tile), d 40 (padded to 64), O a strided view."""
    Z, H, n, d = 1, 3, 37, 40
    o = torch.randn(Z, n, H, d, device=DEVICE).to(torch.bfloat16).transpose(1, 2)
    do = torch.randn(Z, H, n, d, device=DEVICE).to(torch.bfloat16)
    size = Z * H * n * d
    buf = torch.full((size + 64,), float("nan"), device=DEVICE)
    dq32 = buf[:size].view(Z, H, n, d)
    delta = flash_triton._preprocess(o, do, dq32, "dq32")
    assert torch.allclose(delta.double(), (o.double() * do.double()).sum(-1), rtol=1e-5, atol=1e-5)
    assert (dq32 == 0).all() and buf[size:].isnan().all()


# Policy.fused_backward: None (the default: fused in host-bound calls, as every test input here is), False
# (the two atomics-free kernels), True with descriptors off (the fused one on a call not host-bound).
BACKWARDS = {None: {"fwd", "dkdv+dq"}, False: {"fwd", "dq", "dkdv"}, True: {"fwd", "dkdv+dq"}}


@pytest.mark.parametrize("fused", list(BACKWARDS))
@pytest.mark.parametrize("case", [((2,), 4, 1, 37, 29, 32, True, torch.float32),  # GQA, n_q > n_k
                                  ((1,), 3, 3, 1, 47, 64, False, torch.bfloat16),  # one query
                                  ((), 2, 1, 50, 83, 40, True, torch.float16),  # padded d, n_q < n_k, causal
                                  ((1,), 1, 1, 33, 1, 16, False, torch.float32)])  # one key
def test_each_atomics_free_backward_matches_float64(fused, case):
    """The fused backward (dK/dV programs then dQ programs in one launch, each computing D) and the two
    kernels: each against float64 at awkward shapes, and `ran` names what ran."""
    lead, hq, hkv, n_q, n_k, d, causal, dtype = case
    # (True: deterministic too, or an fp32 call that is not host-bound takes the atomic one launch)
    policy = replace(flash_triton.default_policy(), fused_backward=fused, deterministic=True if fused else None,
                     host_bound_flops=0 if fused else flash_triton.default_policy().host_bound_flops)
    ran = _run_and_compare(*_gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed=n_q + n_k), causal, TOL[dtype],
                           policy=policy)
    assert set(ran) == BACKWARDS[fused]


@pytest.mark.skipif(not flash_triton.INTERPRET, reason="interpreter configs (the GPU test tunes for real)")
@pytest.mark.parametrize("deterministic, fused, timings", [(True, False, 4), (False, None, 2), (True, None, 2)])
def test_backward_under_a_real_tuner_run(deterministic, fused, timings, monkeypatch, tmp_path):
    """The tuner with two configs per backward kernel: each timed run is launched twice (a stub bench), so
    a dQ the timing adds into (the atomic backward's, reset before each run and after the timing), or a
    dQ the timing's reset would wipe after the dQ kernel ran (the dQ kernel runs first), shows in the
    result; the fused backward is timed once per config. GQA and a padded head dim."""
    timed = []

    def bench(run):
        run()
        run()
        timed.append(run)
        return 1.0

    monkeypatch.setenv("LMSYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flash_triton.tuning, "bench", bench)
    monkeypatch.setattr(flash_triton.TUNER, "memory", {})
    for name, configs in (("dkdv", [(16, 32), (32, 16)]), ("dq", [(32, 16), (16, 32)])):
        monkeypatch.setitem(flash_triton.CONFIGS, name, [flash_triton._config(m, n, 4, 1) for m, n in configs])
    lead, hq, hkv, n_q, n_k, d, causal, dtype = GQA_CASES[1]
    _run_and_compare(*_gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed=5), causal, TOL[dtype],
                     deterministic=deterministic, policy=replace(flash_triton.default_policy(), fused_backward=fused))
    assert len(timed) == timings  # it did time (the dQ kernel too where it runs alone)


@pytest.mark.skipif(not hasattr(tl_lang(), "make_tensor_descriptor"), reason="triton without tensor descriptors")
@pytest.mark.parametrize("case, deterministic", [(((1,), 4, 2, 37, 29, 80, True, torch.float32), True),
                                                 (((1,), 2, 2, 33, 50, 64, False, torch.bfloat16), True),
                                                 (((1,), 4, 2, 41, 35, 40, True, torch.float32), False)])
def test_tensor_descriptors_and_warp_specialised_forward_match_float64(case, deterministic):
    """Tensor-descriptor loads in the forward and in the backward kernels (padded d, GQA, n_q != n_k);
    deterministic=False: the one-launch backward, dQ by atomics (TMA reduce-adds on a GPU), with
    descriptor loads. warp_specialize is asked for too and turned off by `tma` (triton 3.6 cannot do both);
    then the warp-specialised forward alone."""
    lead, hq, hkv, n_q, n_k, d, causal, dtype = case
    q, k, v = _gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed=n_q)
    policy = flash_triton.Policy(tma=True, tma_backward=True, warp_specialize=True, host_bound_flops=0)
    hopper = DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9
    q_, k_, v_ = (x.to(DEVICE) for x in (q, k, v))  # where the kernels run
    assert flash_triton._tma_usable(policy, q_, k_, v_) == hopper
    assert flash_triton._tma_usable(policy, q_, k_, v_, backward=True) == hopper
    assert not flash_triton._tma_usable(flash_triton.Policy(tma=True), q_, k_, v_, backward=True)
    ran = _run_and_compare(q, k, v, causal, TOL[dtype], deterministic=deterministic, policy=policy)
    assert set(ran) == ({"fwd", "dq", "dkdv"} if deterministic else {"fwd", "dkdv"})
    if deterministic:  # the fused backward's O tiles through descriptors too
        _run_and_compare(q, k, v, causal, TOL[dtype], policy=replace(policy, fused_backward=True))
    _run_and_compare(q, k, v, causal, TOL[dtype], deterministic=deterministic,
                     policy=flash_triton.Policy(warp_specialize=True, host_bound_flops=0))
    # an expanded (stride-0) tensor is never handed to a descriptor
    assert not flash_triton._tma_usable(policy, q_, k_, q_[..., :1, :].expand_as(q_), backward=True)


# (leading dims, Hq, Hkv, n_q, n_k, d, causal, dtype) for the persistent forward: under the interpreter its
# grid is 4 programs, and every case has more work items (query tiles of 32 x batch·heads) than that, so
# each program loops at least twice (odd rounds run the snake backwards; some cases end in a partial round).
PERSISTENT_CASES = [
    ((2,), 4, 1, 75, 53, 40, True, torch.float32),  # GQA (multi-query), padded d, n_q > n_k: 24 items
    ((1,), 3, 3, 45, 70, 64, False, torch.bfloat16),  # n_q < n_k, not causal: 6 items (last round partial)
    ((), 2, 1, 77, 77, 24, True, torch.float16),  # padded d, square causal: 6 items (last round partial)
]


@pytest.mark.parametrize("lead,hq,hkv,n_q,n_k,d,causal,dtype", PERSISTENT_CASES)
def test_persistent_forward_matches_float64(lead, hq, hkv, n_q, n_k, d, causal, dtype, monkeypatch):
    """Policy(persistent=True): min(programs, work items) programs, each looping over (query tile,
    batch·head) items; O, L and the (unchanged) backward's gradients against float64."""
    launched = []
    grid_of = flash_triton._launch

    def record(kernel, grid, args, consts, policy, q, **kw):
        if kernel == "fwd":
            launched.append(grid(CONFIGS_FWD[0].kwargs))
        return grid_of(kernel, grid, args, consts, policy, q, **kw)

    CONFIGS_FWD = flash_triton.CONFIGS["fwd"]
    monkeypatch.setattr(flash_triton, "_launch", record)
    q, k, v = _gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed=n_q + d)
    _run_and_compare(q, k, v, causal, TOL[dtype], policy=flash_triton.Policy(persistent=True))
    items = -(-n_q // CONFIGS_FWD[0].kwargs["BLOCK_M"]) * hq * (lead[0] if lead else 1)
    programs = flash_triton._persistent_programs(DEVICE)
    assert launched == [(min(programs, items),)]
    if DEVICE == "cpu":
        assert items > 4 and programs == 4  # several rounds per program


@pytest.mark.parametrize("hq,hkv", [(4, 3), (2, 4), (6, 4)])
def test_query_heads_not_a_multiple_of_kv_heads(hq, hkv):
    q, k, v = _gqa_inputs((1,), hq, hkv, 9, 9, 16, torch.float32, seed=0)
    with pytest.raises(LmsysError) as info:
        flash_forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    assert f"q has {hq} heads" in str(info.value) and "multiple of the key/value heads" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not flash_triton.INTERPRET, reason="interpreter configs")
@pytest.mark.parametrize("causal", [False, True])
def test_swapped_tile_shapes(causal, monkeypatch):
    """The other orientation of every kernel's tiles (fwd and dQ with BLOCK_N > BLOCK_M, as in the GPU's
    (64, 128) configs; dK/dV with BLOCK_M > BLOCK_N), on shapes that cut tiles in every way."""
    swapped = {"fwd": (16, 32), "dkdv": (32, 16), "dq": (16, 32)}
    monkeypatch.setattr(flash_triton.TUNER, "memory", {})
    for name, tiles in swapped.items():
        monkeypatch.setitem(flash_triton.CONFIGS, name, [flash_triton._config(*tiles, 4, 1)])
    for n_q, n_k in ((71, 71), (50, 83), (83, 37)):
        _run_and_compare(*_inputs((2,), n_q, n_k, 32, torch.float32, seed=n_q + n_k), causal, 1e-4)


def test_saves_exactly_q_k_v_o_and_fp32_logsumexp():
    q = torch.randn(2, 3, 21, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 3, 13, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 3, 13, 16, device=DEVICE, requires_grad=True)
    out = FlashAttentionTriton.apply(q, k, v)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 5 and saved[0] is q and saved[1] is k and saved[2] is v
    assert torch.equal(saved[3], out)
    assert saved[4].shape == q.shape[:-1] and saved[4].dtype == torch.float32


def test_causal_n_q_equals_n_k_matches_naive_and_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 32, device=DEVICE) for _ in range(3))
    out = FlashAttentionTriton.apply(q, k, v, True)
    ref = naive_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), sdpa, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :], rtol=1e-5, atol=1e-5)  # query 0 sees key 0 only


def test_non_contiguous_inputs_and_expanded_grad():
    torch.manual_seed(0)
    base = torch.randn(2, 41, 3, 64, device=DEVICE)  # [B, S, H, d] viewed as [B, H, S, d]: strided, no copy
    q, k, v = (base.transpose(1, 2) * (i + 1) for i in range(3))
    wide = torch.randn(2, 3, 41, 128, device=DEVICE)[..., ::2]  # d not unit-stride: copied
    for kk in (k, wide):
        q_, k_, v_ = (x.detach().requires_grad_() for x in (q, kk, v))
        out = attention(q_, k_, v_, is_causal=True, impl="flash-triton")
        out.sum().backward()  # dO is an expanded (stride-0) tensor
        q64, k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (q, kk, v))
        ref, _ = reference_attention(q64, k64, v64, True)
        ref.sum().backward()
        for got, want in ((out, ref), (q_.grad, q64.grad), (k_.grad, k64.grad), (v_.grad, v64.grad)):
            assert _rel(got, want.detach()) < 1e-4


@pytest.mark.parametrize("d", [8, 12, 20, 84, 264])
def test_head_dim_error_names_the_limit(d):
    q = torch.randn(1, 9, d, device=DEVICE)
    with pytest.raises(LmsysError) as info:
        flash_forward(q, q, q)
    assert f"head dim {d}" in str(info.value) and "multiples of 8 from 16 to 256" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("shapes", [
    ((2, 10, 16), (3, 10, 16), (3, 10, 16)),
    ((2, 10, 16), (2, 9, 16), (2, 10, 16)),
    ((2, 10, 16), (2, 10, 32), (2, 10, 32)),
])
def test_mismatched_shapes_raise_lmsys_error(shapes):
    q, k, v = (torch.randn(s, device=DEVICE) for s in shapes)
    with pytest.raises(LmsysError, match="flash-triton"):
        flash_forward(q, k, v)


@pytest.mark.parametrize("d", [136, 256])
def test_head_dims_past_128_need_16_bit_inputs(d):
    q = torch.randn(1, 9, d, device=DEVICE)
    with pytest.raises(LmsysError, match=f"head dim {d} needs fp16 or bf16"):
        flash_forward(q, q, q)
    out, lse = flash_forward(q.half(), q.half(), q.half())
    assert out.dtype == torch.float16 and lse.dtype == torch.float32


def test_the_names_that_moved_to_flash_stay_importable_from_flash_triton():
    """Policy, the dispatch, the precompile hook, FlashAttentionTriton and the custom ops live in
    lmsys.kernels.flash; from lmsys.kernels.flash_triton they are the same objects, in a fresh process that
    imports flash_triton first (flash imports it: no cycle), and the custom ops are registered."""
    import subprocess
    import sys

    code = ("import lmsys.kernels.flash_triton as ft\n"
            "from lmsys.kernels.flash_triton import FlashAttentionTriton, Policy, flash_attention, kernels_ran\n"
            "import torch\n"
            "from lmsys.kernels import flash\n"
            "assert all(getattr(ft, name) is getattr(flash, name) for name in ft._MOVED)\n"
            "assert FlashAttentionTriton is flash.FlashAttentionTriton and Policy is flash.Policy\n"
            "assert torch.ops.lmsys.flash_fwd.default and torch.ops.lmsys.flash_bwd.default\n"
            "assert not hasattr(ft, 'flash_backward') and not hasattr(flash, 'flash_backward')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        flash_triton.nothing_here  # noqa: B018


def test_unsupported_dtype():
    q = torch.randn(5, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(LmsysError, match="float64"):
        flash_forward(q, q, q)


def test_cpu_tensors_without_interpreter_point_to_flash_torch(monkeypatch):
    monkeypatch.setattr(flash_triton, "INTERPRET", False)
    q = torch.randn(5, 16)
    with pytest.raises(LmsysError) as info:
        flash_forward(q, q, q)
    assert "flash-torch" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("d", [16, 40, 64, 80, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fitting_configs_keep_within_budget(kernel, d, dtype):
    smem = 232448  # an H200's per-block limit, as the device reports it
    elem = torch.empty(0, dtype=dtype).element_size()
    budget = flash_triton._tile_budget(kernel)
    configs = flash_triton.GPU_CONFIGS[kernel]
    pad = flash_triton.head_dim_pad(d)
    kept = flash_triton.fitting_configs(kernel, configs, d_pad=pad, elem=elem, smem=smem)
    assert kept and all(c in configs for c in kept)
    for c in configs:
        acc, need = budget(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], pad, c.num_stages, elem)
        fits = need <= smem and acc / (32 * c.num_warps) <= flash_triton.ACC_PER_THREAD
        assert (c in kept) == fits or kept == [c]
    # a GPU with less shared memory keeps fewer (never none), and no limit keeps every one within registers
    small = flash_triton.fitting_configs(kernel, configs, d_pad=pad, elem=elem, smem=smem // 4)
    assert small and len(small) <= len(kept)
    assert len(flash_triton.fitting_configs(kernel, configs, d_pad=pad, elem=elem, smem=None)) >= len(kept)


@pytest.mark.parametrize("d, dtype, expected", [(64, torch.bfloat16, ["128×64"]), (128, torch.bfloat16, ["128×64"]),
                                                 (80, torch.float32, []), (256, torch.bfloat16, [])])
def test_warp_specialised_forward_runs_only_8_warp_configs_that_fit(d, dtype, expected, monkeypatch):
    """On a GPU triton 3.6's warp-specialisation pass compiles the forward at 8 warps only (every 4-warp
    config failed to compile: scripts/compile_sm90.py); where no 8-warp config fits, the forward runs
    without it. The interpreter compiles nothing: every config stays."""
    monkeypatch.setattr(flash_triton, "INTERPRET", False)
    elem = torch.empty(0, dtype=dtype).element_size()
    kept = flash_triton.warp_spec_configs(flash_triton.GPU_CONFIGS["fwd"], d_pad=flash_triton.head_dim_pad(d),
                                          elem=elem, smem=232448)
    assert [f"{c.kwargs['BLOCK_M']}×{c.kwargs['BLOCK_N']}" for c in kept] == expected
    assert all(c.num_warps >= flash_triton.WARP_SPEC_MIN_WARPS for c in kept)
    monkeypatch.setattr(flash_triton, "INTERPRET", True)
    assert flash_triton.warp_spec_configs(flash_triton.INTERPRETER_CONFIGS["fwd"], d_pad=64, elem=2,
                                          smem=None) == flash_triton.INTERPRETER_CONFIGS["fwd"]


def test_head_dim_pad_is_the_next_power_of_two():
    assert [flash_triton.head_dim_pad(d) for d in (16, 24, 40, 64, 80, 96, 112, 128, 136, 192, 256)] == [
        16, 32, 64, 64, 128, 128, 128, 128, 256, 256, 256]
    assert flash_triton.HEAD_DIMS == tuple(range(16, 257, 8))


def test_shared_memory_comes_from_the_device(monkeypatch):
    """A GPU whose per-block shared memory is smaller than the smallest fp32 tile at d 128: one-line error."""
    assert flash_triton.shared_memory("cpu") is None
    monkeypatch.setattr(flash_triton, "shared_memory", lambda device: 16 * 1024)
    monkeypatch.setattr(flash_triton, "CONFIGS", flash_triton.GPU_CONFIGS)
    monkeypatch.setattr(flash_triton, "FP32_CONFIGS", flash_triton.FP32_GPU_CONFIGS)  # fp32's own list
    flash_triton._smallest_tiles.cache_clear()
    with pytest.raises(LmsysError, match="needs .* bytes of shared memory .* this GPU offers 16384"):
        flash_triton._check_shared_memory(128, torch.float32, "cpu")
    flash_triton._check_shared_memory(16, torch.bfloat16, "cpu")  # small tiles fit
    flash_triton._smallest_tiles.cache_clear()  # computed from the GPU list: not for later tests


# ------------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_long_awkward_shapes(d, dtype, causal, monkeypatch):
    if d in (16, 32, 256) and (dtype != torch.bfloat16 or not causal):
        pytest.skip("d 16, 32, 256: bf16 causal only (compile time)")
    monkeypatch.setenv("LMSYS_FLASH_AUTOTUNE", "0")
    n_q, n_k = (777, 777) if causal else (517, 1331)
    inputs = _inputs((2, 3), n_q, n_k, d, dtype, seed=d)
    assert "dkdv+dq" in _run_and_compare(*inputs, causal, TOL[dtype])  # host-bound: the fused backward
    policy = replace(flash_triton.default_policy(), host_bound_flops=0)  # descriptors, Gluon where it runs
    assert "dkdv+dq" not in _run_and_compare(*inputs, causal, TOL[dtype], policy=policy)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [((2,), 8, 2, 4099, 4099, 80, True, torch.bfloat16),
                                  ((1,), 16, 16, 2053, 3001, 128, False, torch.float16),
                                  ((4,), 4, 1, 2063, 1555, 64, True, torch.float32)])
def test_gpu_persistent_forward_loops_over_more_tiles_than_sms(case):
    """Policy(persistent=True) on a GPU with several work items per SM (each a query tile of 64 or 128)."""
    lead, hq, hkv, n_q, n_k, d, causal, dtype = case
    q, k, v = _gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed=n_q)
    _run_and_compare(q, k, v, causal, TOL[dtype],
                     policy=replace(flash_triton.default_policy(), pick=0, persistent=True))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("case", [(64, torch.bfloat16, True), (128, torch.float32, False), (80, torch.bfloat16, True)])
def test_gpu_every_config_is_correct(kernel, case):
    """Each config that fits, picked by a Policy for `kernel` (the others take their first that fits)."""
    d, dtype, causal = case

    def fitting(name):
        return flash_triton.fitting_configs(name, flash_triton.CONFIGS[name], d_pad=flash_triton.head_dim_pad(d),
                                            elem=torch.empty(0, dtype=dtype).element_size(),
                                            smem=flash_triton.shared_memory("cuda"))

    q, k, v = _inputs((1, 2), 403, 403 if causal else 611, d, dtype, seed=7)
    for config in fitting(kernel):  # the other kernels take their first config that fits (fp32 d 128:
        # the first dK/dV config needs 328,704 bytes of shared memory, the H200 has 232,448)
        configs = {**{name: fitting(name)[:1] for name in flash_triton.CONFIGS}, kernel: [config]}
        try:
            policy = replace(flash_triton.default_policy(), pick=0, configs=configs, host_bound_flops=0)
            _run_and_compare(q, k, v, causal, TOL[dtype], policy=policy)  # the descriptor backward
            if kernel == "dkdv" and flash_triton._fits("dq", config, flash_triton.head_dim_pad(d), q.element_size(),
                                                       flash_triton.shared_memory("cuda")):
                # the fused backward runs the dK/dV configs, its dQ programs too (where their tiles fit)
                _run_and_compare(q, k, v, causal, TOL[dtype], policy=replace(policy, fused_backward=True))
        except AssertionError as exc:
            raise AssertionError(f"{kernel} {config}: {exc}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("tma_reduce", [True, False])
@pytest.mark.parametrize("case", [((2,), 8, 2, 1031, 1031, 80, True, torch.bfloat16),
                                  ((1,), 4, 4, 777, 1201, 64, False, torch.float16)])
def test_gpu_atomic_backward_under_the_tuner(case, tma_reduce, monkeypatch, tmp_path):
    """deterministic=False with the default policy: the tuner times the dK/dV kernel several times on the
    same float32 dQ (zeroed before each run and after the timing); dQ by TMA reduce-adds and by
    element-wise atomics. An empty cache dir and no choices in memory: it times."""
    monkeypatch.setenv("LMSYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flash_triton.TUNER, "memory", {})
    lead, hq, hkv, n_q, n_k, d, causal, dtype = case
    _run_and_compare(*_gqa_inputs(lead, hq, hkv, n_q, n_k, d, dtype, seed=n_q + tma_reduce), causal, TOL[dtype],
                     deterministic=False, policy=replace(flash_triton.default_policy(), tma_reduce_dq=tma_reduce,
                                                         host_bound_flops=0))


@pytest.mark.gpu
def test_gpu_gluon_backward_takes_the_models_strided_views():
    """q, k, v split from one projection and dO from a rearrange's backward, as in the model: the one launch
    runs on contiguous copies (default policy, long enough) and matches float64."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for Hopper")
    _gluon_module()
    torch.manual_seed(5)
    n = flash_triton.DEFAULT_POLICY.gluon_bwd_min_keys
    heads = torch.randn(1, n, (4 + 2 * 2) * 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = heads.view(1, n, 8, 128).transpose(1, 2).split([4, 2, 2], dim=1)  # the model's views, GQA
    assert not any(x.is_contiguous() for x in (q, k, v))
    out = FlashAttentionTriton.apply(q, k, v, True, None, flash_triton.default_policy())
    g = torch.randn(1, n, 4 * 128, device="cuda", dtype=torch.bfloat16)
    (out.transpose(1, 2).reshape(1, n, -1) * g).sum().backward()  # dO arrives as a transposed view
    ran = flash_triton.kernels_ran(out)
    assert ran.get("bwd", "").startswith("gluon"), ran
    h64 = heads.detach().double().requires_grad_()
    q64, k64, v64 = h64.view(1, n, 8, 128).transpose(1, 2).split([4, 2, 2], dim=1)
    o_ref, _ = reference_attention(q64, k64, v64, True, device="cuda")  # the CPU is slow at 4,096 keys
    (o_ref.transpose(1, 2).reshape(1, n, -1) * g.double()).sum().backward()
    assert _rel(heads.grad, h64.grad) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("n, d", [(1500, 64), (1024, 128)])  # d 128 x 1024: where the Gluon one launch runs
def test_gpu_results_are_deterministic(n, d):
    """deterministic=True: bitwise the same twice, also where the default would take the atomic backward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    runs = []
    for _ in range(2):
        out = FlashAttentionTriton.apply(q, k, v, True, True)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_memory_is_linear_in_sequence_length():
    """fwd+bwd peak memory at seq 8192 and 16384 (b1, h16, d64, bf16): twice the length, ~twice the bytes."""
    peaks = []
    for seq in (8192, 16384):
        q, k, v = (torch.randn(1, 16, seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        out = FlashAttentionTriton.apply(q, k, v, True)  # tuning (and do_bench's 256 MB buffer) first
        torch.autograd.grad(out, (q, k, v), do)
        del out
        # garbage in reference cycles (another test's tensors in this worker) freed by a collection inside
        # the measured call would lower its peak below the base: collected first (seen once: 49 MiB at 8,192)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = FlashAttentionTriton.apply(q, k, v, True)
        torch.autograd.grad(out, (q, k, v), do)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del q, k, v, do, out
    assert 1.8 < peaks[1] / peaks[0] < 2.2, peaks


def test_policy_pick_walks_every_fitting_config_and_leaves_the_tuner_alone(monkeypatch):
    """A pick runs the i-th fitting config (mod their number) without touching the tuner's choices;
    launch_forward returns which tiles each kernel ran."""
    two = [flash_triton._config(16, 16, 4, 1), flash_triton._config(32, 16, 4, 1)]
    tuner = flash_triton.TUNER
    cached = dict(tuner.memory)
    q, k, v = (torch.randn(1, 2, 37, 16, device=DEVICE) for _ in range(3))
    configs = {**flash_triton.CONFIGS, "fwd": two}
    for i, expected in enumerate(["16×16", "32×16", "16×16"]):
        policy = flash_triton.Policy(pick=i, configs=configs)
        out, _, ran = flash_triton.launch_forward(q, k, v, False, policy=policy)
        assert ran == {"fwd": expected}
        assert tuner.memory == cached
        torch.testing.assert_close(out, torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="needs a pick"):
        flash_forward(q, k, v, policy=flash_triton.Policy(configs=configs))
    with pytest.raises(ValueError, match="needs a pick"):
        flash_forward(q, k, v, policy=flash_triton.Policy(wide_configs=True))
    wide = flash_triton.Policy(pick=0, wide_configs=True)
    assert wide.configs_for("fwd") == flash_triton.WIDE_CONFIGS["fwd"] + flash_triton.CONFIGS["fwd"]


def test_default_policy_reads_the_environment_once_per_call(monkeypatch):
    monkeypatch.delenv("LMSYS_FLASH_AUTOTUNE", raising=False)
    assert flash_triton.default_policy() is flash_triton.DEFAULT_POLICY and flash_triton.DEFAULT_POLICY.pick is None
    monkeypatch.setenv("LMSYS_FLASH_AUTOTUNE", "0")
    assert flash_triton.default_policy() == replace(flash_triton.DEFAULT_POLICY, pick=0)
    assert flash_triton.DEFAULT_POLICY.pick is None


def test_policy_is_frozen_and_hashable_with_the_shipped_thresholds():
    import dataclasses

    policy = flash_triton.DEFAULT_POLICY
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.pick = 0
    assert (policy.gluon_bwd_min_keys, policy.gluon_copy_min_keys) == (4096, ((128, 16384),))
    assert policy.tma_reduce_dq and not policy.warp_spec_with_tma and not policy.wide_configs
    assert policy.gluon_copy_from(128) == 16384 and policy.gluon_copy_from(64) == float("inf")
    # the Gluon kernels at d 16 and 32 only from 8,192 keys not causal and 16,384 causal; d 64/128 at any
    assert policy.gluon_small_min_keys == ((False, 8192), (True, 16384))
    for d, causal, keys in ((16, False, 8192), (32, False, 8192), (16, True, 16384), (32, True, 16384),
                            (64, True, 0), (64, False, 0), (128, True, 0), (128, False, 0)):
        assert policy.gluon_from(d, causal) == keys, (d, causal)
    two = [flash_triton._config(16, 16, 4, 1)]
    picked = flash_triton.Policy(pick=0, configs={"fwd": two}, gluon_copy_min_keys={64: 8})
    assert picked.configs == (("fwd", tuple(two)),) and picked.gluon_copy_min_keys == ((64, 8),)
    assert picked.configs_for("fwd") == two and hash(policy) == hash(replace(policy))


# ------------------------------------------------------------------ the Gluon forward (Policy.gluon)


def _gluon_module():
    return pytest.importorskip("lmsys.kernels.flash_gluon", exc_type=ImportError)


@pytest.mark.parametrize("q_shape, kv_shape, dtype, ok", [
    ((2, 4, 256, 128), (2, 4, 256, 128), torch.bfloat16, True),
    ((1, 8, 384, 128), (1, 2, 384, 128), torch.float16, True),  # grouped-query
    ((1, 8, 128, 128), (1, 1, 128, 128), torch.bfloat16, True),  # multi-query
    ((1, 2, 256, 64), (1, 2, 256, 64), torch.bfloat16, True),  # d 64
    ((1, 2, 256, 32), (1, 2, 256, 32), torch.bfloat16, True),  # d 32 and 16 (from gluon_small_min_keys keys)
    ((1, 2, 256, 16), (1, 2, 256, 16), torch.float16, True),
    ((1, 2, 256, 48), (1, 2, 256, 48), torch.bfloat16, False),  # d 48: no tiles of its own
    ((1, 2, 256, 80), (1, 2, 256, 80), torch.bfloat16, False),  # d 80: the tl kernel's padded path
    ((1, 2, 200, 128), (1, 2, 200, 128), torch.bfloat16, False),  # not a multiple of the tiles
    ((1, 2, 256, 128), (1, 2, 384, 128), torch.bfloat16, False),  # n_q != n_k
    ((1, 2, 256, 128), (1, 2, 256, 128), torch.float32, False),  # fp32: tf32x3 in the tl kernel
    ((1, 6, 256, 128), (1, 4, 256, 128), torch.bfloat16, False),  # heads not a multiple
])
def test_gluon_forward_supports_only_what_it_computes(q_shape, kv_shape, dtype, ok):
    gluon = _gluon_module()
    q = torch.zeros(q_shape, dtype=dtype)
    k, v = torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype)
    assert gluon.supports(q, k, v) == ok
    assert not gluon.usable(q, k, v)  # not on a CPU
    if ok:  # a strided view is refused too
        assert not gluon.supports(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)
    d96 = torch.zeros(1, 2, 256, 96, dtype=torch.bfloat16)
    assert not gluon.supports(d96, d96, d96, gluon.Config(128, 128, 2, 0, 8, 168))  # a config is not a head dim


def test_gluon_forward_runs_only_with_the_triton_it_was_written_for(monkeypatch):
    """Gluon's API moves between releases (3.9 renamed the TMA copies the kernel calls): any other triton
    gets the tl forward instead of a compile error."""
    gluon = _gluon_module()
    for version, ok in (("3.6.0", True), ("3.6.1", True), ("3.5.1", False), ("3.9.0", False), ("3.10.0", False)):
        monkeypatch.setattr(gluon.triton, "__version__", version)
        assert gluon.available() == ok, version


def test_gluon_forward_refuses_empty_inputs_and_grids_past_cuda_limits(monkeypatch):
    gluon = _gluon_module()
    empty = torch.zeros(0, 2, 128, 128, dtype=torch.bfloat16)
    assert not gluon.supports(empty, empty, empty)
    x = torch.zeros(2, 4, 128, 128, dtype=torch.bfloat16)
    assert gluon.supports(x, x, x)
    monkeypatch.setattr(gluon, "MAX_GRID_Y", 7)  # batch·heads go on the grid's second dimension
    assert not gluon.supports(x, x, x)


def _compile_for_hopper(which: str) -> list[list[str]]:
    """tests/helpers/hopper_compile.py's lines (name, what, grid=..., shared bytes, regs=, spill=, ptxas=)
    for `which` kernels."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).parent / "helpers" / "hopper_compile.py"
    done = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split() for line in done.stdout.splitlines()]


def _ptxas(fields: list[str]) -> tuple[int, int, str]:
    """(registers, bytes spilled, advisories or "-") of a line's regs=, spill=, ptxas= fields."""
    notes = dict(f.split("=", 1) for f in fields)
    return int(notes["regs"]), int(notes["spill"]), notes["ptxas"]


@pytest.mark.slow
def test_tl_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter runs the tl kernels' arithmetic but compiles nothing: every launch the launchers make
    (bf16 and fp32, causal or not, the backward's pair, one atomic launch, fused launch, heads_fast off; the
    backward with tensor descriptors as on Hopper, and its pair without) is compiled to an sm_90 cubin, and
    causal grids put the tiles last (heads first, `_grid`) unless Policy.heads_fast is off or the backward
    is fused (host-bound calls: its grid stays in order)."""
    lines = _compile_for_hopper("tl")
    assert {name for name, *_ in lines} == {"_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv", "_attn_bwd_preprocess"}
    for dtype in ("bfloat16", "float32"):
        for causal in ("True", "False"):
            for backward in ("pair", "atomic", "fused", "head-by-head", "pointers"):
                assert any(what == f"{dtype}/causal={causal}/{backward}" for _, what, *_ in lines)
    for name, what, grid, shared, *notes in lines:
        dims = [int(x) for x in grid.removeprefix("grid=").split(",")]
        assert int(shared) <= 232448  # an H100's shared memory per block
        registers, spilled, advisories = _ptxas(notes)
        if name in ("_attn_fwd", "_attn_bwd_dq") and what.startswith("bfloat16"):
            # the 16-bit forward and dQ kernels as ptxas leaves them today: no spill, no wgmma serialised
            # (the dK/dV kernel's and fp32's are not: docs/benchmarks/attention-ptxas-2026-12-07.md)
            assert (spilled, advisories) == (0, "-"), (name, what, registers, spilled, advisories)
        if name != "_attn_bwd_preprocess":  # (2, 2, 384, 64): batch 2, heads 2 first when causal
            heads_fast = ("causal=True" in what and "head-by-head" not in what
                          and not (name == "_attn_bwd_dkdv" and what.endswith("fused")))
            assert (dims[:2] == [2, 2]) == heads_fast, (name, what, dims)  # (fused: host-bound, in order)


def test_gluon_kernels_compile_for_hopper_without_a_gpu():
    """Gluon has no interpreter, so a CPU can only compile it: under the triton flash_gluon was written for
    (CI's second pass), every Gluon kernel at d 64 and 128, causal in both grid orders and not causal, is
    compiled to an sm_90 cubin, and ptxas neither serialises its wgmmas (C7510-C7519: each then waits for
    the one before, and no other CPU test notices) nor spills more than the one register of d 128's causal
    backward (4 bytes)."""
    gluon = _gluon_module()
    if not any(gluon.triton.__version__.startswith(r) for r in gluon.TRITON_RELEASES):
        pytest.skip(f"flash_gluon is written for triton {gluon.TRITON_RELEASES}, not {gluon.triton.__version__}")
    lines = _compile_for_hopper("gluon")
    assert len(lines) == 18, lines
    assert {(name, what.split("/")[0]) for name, what, *_ in lines} == {
        (k, d) for k in ("_attn_fwd_ws", "_attn_bwd_ws", "_scale_cast") for d in ("d64", "d128")}
    assert all(int(shared) <= 232448 for _, _, _, shared, *_ in lines)
    for name, what, grid, _, *notes in lines:  # 1,024 keys: 8 query or key tiles of 128; 4 batch·heads first when causal
        if name != "_scale_cast":
            assert grid == ("grid=4,8" if what.endswith("causal=True/heads_fast=True") else "grid=8,4"), (name, what)
        registers, spilled, advisories = _ptxas(notes)
        assert advisories == "-" and spilled <= 4, (name, what, registers, spilled, advisories)


@pytest.mark.parametrize("args, message", [((128, 128, 3, 1, 4, 168), "needs 8 warps"),
                                           ((64, 128, 1, 2, 4, 128), "pipeline 2 with 1 stages"),
                                           ((64, 128, 2, 3, 4, 128), "pipeline 3"),
                                           ((64, 96, 2, 0, 4, 128), "divide"),
                                           ((64, 128, 2, 1, 4, 128, 2), "2 consumers of 4 warps"),
                                           ((128, 128, 2, 1, 8, 168, 3), "3 consumers"),
                                           ((128, 128, 2, 1, 8, 128, 2), "maxnreg 168")])
def test_gluon_config_refuses_what_would_hang_or_miscompute(args, message):
    gluon = _gluon_module()
    with pytest.raises(ValueError, match=message):
        gluon.Config(*args)
    assert gluon.Config(64, 128, 1, 0, 4, 128)  # one stage is fine when nothing is pipelined


def test_gluon_policy_runs_the_tl_kernels_where_gluon_cannot():
    """Policy(gluon=True) off a Hopper GPU (here: the interpreter) runs the tl forward and, with the default
    deterministic=None, the atomics-free tl backward: same results."""
    policy = replace(flash_triton.default_policy(), gluon=True)
    assert policy.deterministic is None
    q, k, v = _gqa_inputs((1,), 4, 2, 128, 128, 128, torch.bfloat16, seed=3)
    ran = _run_and_compare(q, k, v, True, TOL[torch.bfloat16], policy=policy)
    if DEVICE == "cpu":  # a host-bound call: the fused tl backward
        assert not ran["fwd"].startswith("gluon")
        assert "bwd" not in ran and "dkdv+dq" in ran


def test_gluon_backward_takes_only_what_it_computes():
    """The one-launch backward: d 64 and 128 (the head dims the forward's tiles take), the forward's other
    conditions with its own tiles, and dO like q."""
    gluon = _gluon_module()
    x = torch.zeros(2, 4, 256, 128, dtype=torch.bfloat16)
    config = gluon.BWD_CONFIGS[128]
    assert gluon.supports(x, x, x, config)
    assert not gluon.usable_backward(x, x, x, x)  # not on a CPU
    d64 = torch.zeros(2, 4, 256, 64, dtype=torch.bfloat16)
    assert set(gluon.BWD_CONFIGS) == set(gluon.HEAD_DIMS) == {16, 32, 64, 128}
    assert gluon.supports(d64, d64, d64, gluon.BWD_CONFIGS[64])
    d80 = torch.zeros(2, 4, 256, 80, dtype=torch.bfloat16)
    assert not gluon.supports(d80, d80, d80, gluon.BWD_CONFIGS[64])
    odd = torch.zeros(2, 4, 192, 128, dtype=torch.bfloat16)  # a multiple of 64, not of the 128-key tiles
    assert not gluon.supports(odd, odd, odd, config)
    assert gluon.supports(d64, d64, d64, gluon.BwdConfig(64, 64, 2, 4, 168))


@pytest.mark.parametrize("first_m, n_m, group", [(0, 4, 1), (3, 4, 1), (0, 1, 3), (2, 9, 4), (6, 8, 2)])
def test_gluon_backward_walks_every_query_tile_of_the_group_in_order(first_m, n_m, group):
    """Both backward partitions walk (query head of the group, query tile) with `_next_tile` carried from
    tile to tile, not with divisions (Gluon runs only on a GPU; its Python body runs on ints here): the
    rows t // per_head · N + (first_m + t % per_head) · BLOCK_M in order, the first again after the last
    (the compute partition loads the next tile's L and D one tile ahead, in bounds)."""
    gluon = _gluon_module()
    n_ctx, block_m, row0 = n_m * 64, 64, 5 * 1024
    per_head = n_m - first_m
    m, head_row, rows = first_m, row0, []
    for _ in range(group * per_head + 1):
        rows.append(head_row + m * block_m)
        m, head_row = gluon._next_tile.fn(m, head_row, first_m, n_m, n_ctx, row0, row0 + group * n_ctx)
    assert rows[:-1] == [row0 + (t // per_head) * n_ctx + (first_m + t % per_head) * block_m
                         for t in range(group * per_head)]
    assert rows[-1] == rows[0]


class _FakeGluon:
    """flash_gluon's backward interface, computing in float64 on any device: flash_backward's dispatch to
    the Gluon one launch (which copies strided inputs, needs D first, and adds into a zeroed float32 dQ
    that it casts into dQ),
    checked where no Hopper GPU runs it."""

    def __init__(self, gluon):
        self.BWD_CONFIGS, self.calls, self.heads_fast = gluon.BWD_CONFIGS, [], []
        self._supports = gluon.supports

    def usable(self, q4, k4, v4, config=None, layout=True):  # the forward stays the tl one here
        return False

    def usable_backward(self, q4, k4, v4, do4, config=None, layout=True):
        config = config or self.BWD_CONFIGS.get(q4.shape[-1])
        return (config is not None and self._supports(q4, k4, v4, config, layout)
                and (not layout or do4.is_contiguous()))

    def backward(self, q4, k4, v4, do4, lse, delta, dq32, dq4, dk4, dv4, is_causal, prepare=None, heads_fast=True):
        assert prepare is None  # (these tests run the backward, not its precompile)
        assert all(x.is_contiguous() for x in (q4, k4, v4, do4)) and dq32.dtype == torch.float32
        self.heads_fast.append(heads_fast)
        assert dq4.dtype == q4.dtype and dq4.shape == q4.shape
        assert not dq32.any()  # zeroed: the kernel adds into it
        self.calls.append(q4.shape)
        with torch.enable_grad():  # called from autograd's backward
            q64, k64, v64 = (x.double().cpu().requires_grad_() for x in (q4, k4, v4))
            o_ref, _ = reference_attention(q64, k64, v64, is_causal)  # (on the CPU)
            dq, dk, dv = torch.autograd.grad(o_ref, (q64, k64, v64), do4.double().cpu())
        assert _rel(delta.cpu(), (o_ref.detach() * do4.double().cpu()).sum(-1)) < 2e-2  # D is ready (bf16 O)
        dq32.add_(dq.to(dq32)), dk4.copy_(dk), dv4.copy_(dv), dq4.copy_(dq32)
        return "fake 64×128"


def test_gluon_runs_at_small_head_dims_only_from_their_keys(monkeypatch):
    """d 16 and 32: the Gluon kernels (forward and the one-launch backward) only from gluon_small_min_keys
    keys (not causal 8,192, causal 16,384, lowered here to 256 and 512); below, the tl kernels; d 64 does
    not wait. The results match float64 either way."""
    fake = _FakeGluon(_gluon_module())
    monkeypatch.setattr(flash, "_gluon", lambda: fake)
    for d, n, causal, gluon in [(32, 256, False, True), (32, 256, True, False), (16, 512, True, True),
                                (16, 128, False, False), (64, 128, True, True)]:
        q, k, v = _gqa_inputs((1,), 2, 2, n, n, d, torch.bfloat16, seed=d + n)
        policy = replace(flash_triton.default_policy(), gluon_bwd_min_keys=1, host_bound_flops=0,
                         gluon_small_min_keys=((False, 256), (True, 512)))
        fake.calls.clear()
        ran = _run_and_compare(q, k, v, causal, TOL[torch.bfloat16], policy=policy)
        assert ("bwd" in ran) == gluon and bool(fake.calls) == gluon, (d, n, causal, ran)


def test_host_bound_calls_run_the_tl_kernels_without_descriptors(monkeypatch):
    """A call of at most Policy.host_bound_flops forward FLOPs (4·Z·H·n_q·n_k·d) skips the Gluon kernels and
    tensor descriptors, forward and backward, whatever gluon/tma/tma_backward say; one FLOP more and
    the policy runs as asked. Both match float64."""
    fake = _FakeGluon(_gluon_module())
    monkeypatch.setattr(flash, "_gluon", lambda: fake)
    asked = []
    usable = flash_triton._tma_usable
    monkeypatch.setattr(flash_triton, "_tma_usable",
                        lambda policy, *t, backward=False: asked.append(usable(policy, *t, backward=backward)) or asked[-1])
    q, k, v = _gqa_inputs((1,), 2, 2, 128, 128, 64, torch.bfloat16, seed=5)
    flops = 4 * 2 * 128 * 128 * 64
    for limit, host_bound in [(flops, True), (flops - 1, False)]:
        policy = replace(flash_triton.default_policy(), gluon_bwd_min_keys=1, tma=True, host_bound_flops=limit)
        fake.calls.clear(), asked.clear()
        ran = _run_and_compare(q, k, v, True, TOL[torch.bfloat16], policy=policy)
        assert ("bwd" in ran) != host_bound and bool(fake.calls) != host_bound, (limit, ran)
        assert asked and any(asked) != host_bound, (limit, asked)  # the interpreter takes descriptors
        assert ("dkdv+dq" in ran) == host_bound  # the fused backward in host-bound calls only
    for fused, deterministic, kernels in [(False, None, {"dq", "dkdv"}), (None, False, {"dkdv"})]:
        policy = replace(flash_triton.default_policy(), fused_backward=fused)  # never fused; atomics
        ran = _run_and_compare(q, k, v, True, TOL[torch.bfloat16], deterministic=deterministic, policy=policy)
        assert set(ran) - {"fwd"} == kernels, (fused, deterministic, ran)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_backward_takes_the_atomic_one_launch_unless_host_bound_or_deterministic(dtype):
    """deterministic=None on fp32 inputs: the tl one launch with atomics where the call is not host-bound, the
    fused atomics-free one where it is, the two kernels with True; 16-bit inputs keep the atomics-free pair.
    Each against float64 (GQA, n_q ≠ n_k, lengths off the tiles)."""
    q, k, v = _gqa_inputs((1,), 4, 2, 45, 71, 64, dtype, seed=11)
    flops = attention_flops(batch=1, heads=4, n_queries=45, n_keys=71, d_head=64, causal=False, direction="fwd")
    fp32 = dtype == torch.float32
    for limit, deterministic, kernels in [(flops - 1, None, {"dkdv"} if fp32 else {"dq", "dkdv"}),
                                          (flops, None, {"dkdv+dq"}), (flops - 1, True, {"dq", "dkdv"})]:
        policy = replace(flash_triton.default_policy(), host_bound_flops=limit)
        ran = _run_and_compare(q, k, v, True, TOL[dtype], deterministic=deterministic, policy=policy)
        assert set(ran) - {"fwd"} == kernels, (limit, deterministic, ran)
    if fp32:  # outside flash.FP32_ATOMIC_HEAD_DIMS (d 32: a tie on an H200, d 16 slower): the atomics-free pair
        q, k, v = _gqa_inputs((1,), 2, 2, 45, 71, 32, dtype, seed=12)
        policy = replace(flash_triton.default_policy(), host_bound_flops=0)
        assert set(_run_and_compare(q, k, v, False, TOL[dtype], policy=policy)) == {"fwd", "dq", "dkdv"}


def test_flash_backward_takes_the_gluon_one_launch_where_the_policy_says(monkeypatch):
    """deterministic=None: the one launch from Policy.gluon_bwd_min_keys keys, with strided views copied; True:
    never; False: at any length. The results match float64 either way, and `ran` names what ran."""
    fake = _FakeGluon(_gluon_module())
    monkeypatch.setattr(flash, "_gluon", lambda: fake)
    q, k, v = _gqa_inputs((1,), 4, 2, 128, 128, 128, torch.bfloat16, seed=11)
    k, v = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (k, v))  # strided, like the model's
    expected = []
    for deterministic, min_keys, gluon in [(None, 4096, False), (None, 128, True), (True, 128, False),
                                           (False, 4096, True)]:
        policy = replace(flash_triton.default_policy(), gluon_bwd_min_keys=min_keys, host_bound_flops=0)
        ran = _run_and_compare(q, k, v, True, TOL[torch.bfloat16], deterministic=deterministic, policy=policy)
        expected += [(1, 4, 128, 128)] * gluon
        assert fake.calls == expected, (deterministic, min_keys)
        kernels = {kernel for kernel in ("bwd", "dq", "dkdv") if kernel in ran}
        assert kernels == ({"bwd"} if gluon else {"dq", "dkdv"}), (deterministic, min_keys, ran)


def test_the_policys_grid_order_reaches_the_gluon_backward(monkeypatch):
    """Policy.heads_fast (default on) is what the Gluon one launch is given; off, the results are the same."""
    fake = _FakeGluon(_gluon_module())
    monkeypatch.setattr(flash, "_gluon", lambda: fake)
    q, k, v = _gqa_inputs((1,), 4, 2, 128, 128, 128, torch.bfloat16, seed=12)
    for heads_fast in (True, False):
        policy = replace(flash_triton.default_policy(), gluon_bwd_min_keys=128, host_bound_flops=0,
                         heads_fast=heads_fast)
        assert "bwd" in _run_and_compare(q, k, v, True, TOL[torch.bfloat16], policy=policy)
    assert fake.heads_fast == [True, False]


@pytest.mark.parametrize("fused, deterministic", [(False, None), (True, None), (None, False)])
@pytest.mark.parametrize("heads_fast", [True, False])
def test_causal_grids_in_either_order_match_float64(heads_fast, fused, deterministic):
    """The tl kernels with causal grids heads-fast (the default: tiles on the grid's last dimension, counted
    from the heaviest) or head by head, at batch 2 with grouped-query heads, n_q != n_k and lengths that are
    no multiple of the tiles: the forward and every backward (the pair, fused, atomic) against float64."""
    q, k, v = _gqa_inputs((2,), 4, 2, 75, 93, 32, torch.float32, seed=5)
    policy = replace(flash_triton.default_policy(), heads_fast=heads_fast, fused_backward=fused, host_bound_flops=0)
    ran = _run_and_compare(q, k, v, True, TOL[torch.float32], deterministic=deterministic, policy=policy)
    assert ("dkdv+dq" in ran) == bool(fused) and ("dq" in ran) == (fused is False and deterministic is None)


@pytest.mark.parametrize("args, message", [((128, 64, 2, 4, 168), "needs 64 or 128"),  # one warp group, m128
                                           ((32, 128, 2, 8, 168), "needs 64 or 128"),
                                           ((64, 64, 2, 8, 168), "needs 64 or 128"),
                                           ((64, 128, 0, 8, 168), "needs 64 or 128"),
                                           ((64, 128, 2, 8, 200), "register file"),
                                           ((64, 112, 2, 7, 168), "needs 64 or 128")])  # not whole warp groups
def test_gluon_backward_config_refuses_what_cannot_launch(args, message):
    gluon = _gluon_module()
    with pytest.raises(ValueError, match=message):
        gluon.BwdConfig(*args)


# (leading dims, Hq, Hkv, n, d, causal, dtype): shapes the Gluon forward takes (n a multiple of 128)
GLUON_CASES = [
    ((2,), 4, 4, 256, 64, True, torch.bfloat16),
    ((2,), 2, 1, 128, 64, False, torch.float16),  # multi-query, not causal
    ((2,), 4, 4, 256, 128, True, torch.bfloat16),
    ((1,), 8, 2, 384, 128, True, torch.bfloat16),  # grouped-query
    ((2,), 2, 1, 128, 128, False, torch.float16),  # multi-query, not causal
    ((1,), 2, 2, 512, 128, False, torch.float16),
    ((1,), 2, 1, 1536, 64, True, torch.bfloat16),  # long enough that the K/V ring wraps
    ((2, 1), 4, 2, 1024, 128, True, torch.float16),  # five dims, grouped-query, the ring wraps
    ((2,), 4, 2, 512, 32, True, torch.bfloat16),  # d 32 and 16 on d 64's tiles (gluon_small_min_keys lowered)
    ((1,), 3, 3, 384, 16, False, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GLUON_CASES)
def test_gpu_gluon_forward_and_backward_match_float64(case):
    """The Gluon forward's O and L, and the gradients of the Gluon one-launch backward (d 128, the default
    policy) or the tl backward from the Gluon forward's L, against float64."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for Hopper")
    gluon = _gluon_module()
    lead, hq, hkv, n, d, causal, dtype = case
    q, k, v = _gqa_inputs(lead, hq, hkv, n, n, d, dtype, seed=n + d)
    # through flash-triton; deterministic=False: the one launch below gluon_bwd_min_keys too; d 16/32 at
    # any length; these small cases are not taken as host-bound
    policy = replace(flash_triton.default_policy(), gluon=True, deterministic=False, host_bound_flops=0,
                     gluon_small_min_keys=((False, 0), (True, 0)))
    ran = _run_and_compare(q, k, v, causal, TOL[dtype], policy=policy)
    assert ran["fwd"].startswith("gluon")
    if d in gluon.BWD_CONFIGS:
        assert ran.get("bwd", "").startswith("gluon"), ran
    ran = _run_and_compare(q, k, v, causal, TOL[dtype], policy=replace(policy, deterministic=True))
    assert "bwd" not in ran and "dkdv" in ran  # the tl kernels from the Gluon forward's L


@pytest.mark.gpu
def test_gpu_gluon_forward_takes_the_models_strided_views_as_copies(monkeypatch):
    """The model's q, k, v (strided views, GQA) at a head dim and length Policy.gluon_copy_min_keys lists: the Gluon
    forward runs on the copies and matches float64 (the threshold lowered so that the test is short)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for Hopper")
    _gluon_module()
    torch.manual_seed(6)
    n = 1024
    heads = torch.randn(2, n, (4 + 2 * 2) * 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = heads.view(2, n, 8, 128).transpose(1, 2).split([4, 2, 2], dim=1)
    policy = replace(flash_triton.default_policy(), gluon_copy_min_keys=((128, 1024),), host_bound_flops=0)
    o, lse, ran = flash_triton.launch_forward(q, k, v, True, policy=policy)
    assert ran["fwd"].startswith("gluon"), ran
    o_ref, lse_ref = reference_attention(q, k, v, True, device="cuda")
    assert _rel(o, o_ref) < TOL[torch.bfloat16] and _rel(lse, lse_ref) < 1e-3


@pytest.mark.parametrize("d, n, copies", [(128, 256, True), (128, 128, False), (64, 256, False)])
def test_forward_copies_strided_views_only_where_the_gluon_forward_was_measured_faster(monkeypatch, d, n, copies):
    """Policy.gluon_copy_min_keys: the model's q, k, v (strided views of one projection) reach the Gluon forward
    as contiguous copies at the head dims and lengths listed there, and the tl forward in place elsewhere.
    The rule is under test, not the kernel: a stand-in for flash_gluon takes what the real one takes
    (contiguous inputs) and answers in float64."""
    class StandIn:
        @staticmethod
        def usable(q4, k4, v4, config=None, layout=True):
            return not layout or all(x.is_contiguous() for x in (q4, k4, v4))

        @staticmethod
        def forward(q4, k4, v4, o4, lse, is_causal, config=None, heads_fast=True):
            assert all(x.is_contiguous() for x in (q4, k4, v4))
            o_ref, lse_ref = reference_attention(q4, k4, v4, is_causal)
            o4.copy_(o_ref)
            lse.copy_(lse_ref)
            return "gluon stand-in"

    monkeypatch.setattr(flash, "_gluon", lambda: StandIn)
    torch.manual_seed(d + n)
    heads = torch.randn(1, n, 3 * 2 * d, dtype=torch.bfloat16, device=DEVICE)
    q, k, v = heads.view(1, n, 6, d).transpose(1, 2).split(2, dim=1)  # the model's views
    policy = replace(flash_triton.default_policy(), gluon=True, gluon_copy_min_keys=((128, 256),), host_bound_flops=0)
    o, lse, ran = flash_triton.launch_forward(q, k, v, True, policy=policy)
    assert ran["fwd"].startswith("gluon") == copies, ran
    o_ref, lse_ref = reference_attention(q, k, v, True)
    assert _rel(o, o_ref) < TOL[torch.bfloat16] and _rel(lse, lse_ref) < 1e-3


# ------------------------------------------------------------- torch.compile: the custom ops


def _tiny_model(attn_impl: str, dtype=torch.float32, device="cpu"):
    from lmsys.model.config import PRESETS
    from lmsys.model.transformer import TransformerLM

    cfg = PRESETS["tiny"].with_overrides(context_length=40, vocab_size=512, attn_impl=attn_impl)
    torch.manual_seed(0)
    return TransformerLM(cfg, dtype=dtype).to(device)


def _loss_and_grads(model, x, y, forward=None):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy((model if forward is None else forward)(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def test_compiled_model_keeps_one_graph_through_flash_triton_and_matches_eager_and_float64():
    """attn_impl="flash-triton" under torch.compile: Dynamo traces through the custom ops (no graph break),
    and the compiled loss and gradients (aot_eager: fake tensors and AOT autograd through the ops' fake
    implementations and registered backward) match eager's and a float64 model's with naive attention."""
    model = _tiny_model("flash-triton", device=DEVICE)
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    x, y = (torch.randint(0, 512, (2, 37), generator=g) for _ in range(2))  # 37: partial tiles
    cpu_x, cpu_y = x, y
    x, y = x.to(DEVICE), y.to(DEVICE)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    eager_loss, eager_grads = _loss_and_grads(model, x, y)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss, grads = _loss_and_grads(model, x, y, forward=compiled)
    reference = _tiny_model("naive", torch.float64)
    reference.load_state_dict({name: p.double().cpu() for name, p in model.state_dict().items()})
    ref_loss, ref_grads = _loss_and_grads(reference, cpu_x, cpu_y)
    assert abs(loss.item() - eager_loss.item()) < 1e-5 and abs(loss.item() - ref_loss.item()) < 1e-4
    for name, ref in ref_grads.items():
        assert _rel(grads[name], eager_grads[name]) < 1e-5, name
        assert _rel(grads[name], ref) < 1e-4, name


def test_custom_ops_pass_opcheck():
    """The ops' schemas, fake implementations, autograd registration and AOT dispatch (torch.library.opcheck),
    on grouped-query inputs of awkward lengths; their results against float64."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 21, 16, generator=g).to(DEVICE).requires_grad_()
    k, v = (torch.randn(1, 2, 27, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    o, lse = torch.ops.lmsys.flash_fwd(q, k, v, False)
    o_ref, lse_ref = reference_attention(q, k, v, False)
    assert _rel(o, o_ref) < 1e-4 and _rel(lse, lse_ref) < 1e-4
    do = torch.randn_like(o)
    dq, dk, dv = torch.ops.lmsys.flash_bwd(do, q, k, v, o, lse, False)
    for got, ref in zip((dq, dk, dv), torch.autograd.grad(o_ref, (q, k, v), do.double().to(o_ref.device))):
        assert _rel(got, ref) < 1e-4
    torch.library.opcheck(torch.ops.lmsys.flash_fwd.default, (q, k, v, True))
    # the backward op has no backward of its own (no double backward): checked on inputs without grad
    torch.library.opcheck(torch.ops.lmsys.flash_bwd.default,
                          tuple(x.detach() for x in (do, q, k, v, o, lse)) + (False,))
