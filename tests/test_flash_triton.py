"""FlashAttentionTriton against float64: in Triton's interpreter on a CPU, compiled on a GPU (`gpu` marker).

Under the interpreter the kernels use one small config (BLOCK_M 32 / BLOCK_N 16 forward, 16/32 for dK/dV,
32/16 for dQ), so inputs of a few dozen rows already span several tiles, partial edge tiles and, when
causal, diagonal tiles whose query and key tiles differ in size.
"""

from __future__ import annotations

import random

import pytest
import torch

from lmsys.core.errors import LmsysError
from lmsys.kernels import flash_triton
from lmsys.kernels.attention import attention, naive_attention
from lmsys.kernels.flash_check import reference_attention, relative_error
from lmsys.kernels.flash_triton import FlashAttentionTriton, flash_forward

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(x, ref):
    """Relative error for tensors of magnitude >= 1, absolute below (zero gradients, e.g. one key)."""
    return relative_error(x, ref)


def _run_and_compare(q, k, v, causal, tol):
    """Forward + backward on DEVICE; O, the saved L and dQ, dK, dV against float64 on the CPU."""
    q_, k_, v_ = (x.detach().to(DEVICE).requires_grad_() for x in (q, k, v))
    out = FlashAttentionTriton.apply(q_, k_, v_, causal)
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


@pytest.mark.skipif(not flash_triton.INTERPRET, reason="interpreter configs")
@pytest.mark.parametrize("causal", [False, True])
def test_swapped_tile_shapes(causal, monkeypatch):
    """The other orientation of every kernel's tiles (fwd and dQ with BLOCK_N > BLOCK_M, as in the GPU's
    (64, 128) configs; dK/dV with BLOCK_M > BLOCK_N), on shapes that cut tiles in every way."""
    swapped = {"fwd": (16, 32), "dkdv": (32, 16), "dq": (16, 32)}
    for name, tuner in (("fwd", flash_triton._attn_fwd), ("dkdv", flash_triton._attn_bwd_dkdv),
                        ("dq", flash_triton._attn_bwd_dq)):
        monkeypatch.setattr(tuner, "configs", [flash_triton._config(*swapped[name], 4, 1)])
        monkeypatch.setattr(tuner, "cache", {})
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


def test_head_dim_error_names_the_limit():
    q = torch.randn(1, 9, 80, device=DEVICE)
    with pytest.raises(LmsysError) as info:
        flash_forward(q, q, q)
    assert "head dim 80" in str(info.value) and "16, 32, 64, 128, 256" in str(info.value)


@pytest.mark.parametrize("shapes", [
    ((2, 10, 16), (3, 10, 16), (3, 10, 16)),
    ((2, 10, 16), (2, 9, 16), (2, 10, 16)),
    ((2, 10, 16), (2, 10, 32), (2, 10, 32)),
])
def test_mismatched_shapes_raise_lmsys_error(shapes):
    q, k, v = (torch.randn(s, device=DEVICE) for s in shapes)
    with pytest.raises(LmsysError, match="flash-triton"):
        flash_forward(q, k, v)


def test_head_dim_256_needs_16_bit_inputs():
    q = torch.randn(1, 9, 256, device=DEVICE)
    with pytest.raises(LmsysError, match="head dim 256 needs fp16 or bf16"):
        flash_forward(q, q, q)
    out, lse = flash_forward(q.half(), q.half(), q.half())
    assert out.dtype == torch.float16 and lse.dtype == torch.float32


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
@pytest.mark.parametrize("d", flash_triton.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autotune_filter_keeps_configs_within_budget(kernel, d, dtype, monkeypatch):
    prune = flash_triton._prune_by_head_dim(kernel)
    budget = flash_triton._tile_budget(kernel)
    args = {"Q": torch.empty(1, dtype=dtype)}
    configs = flash_triton.GPU_CONFIGS[kernel]
    kept = prune(configs, args, HEAD_DIM=d)
    assert kept and all(c in configs for c in kept)
    for c in kept:
        acc, smem = budget(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], d, c.num_stages, torch.empty(0, dtype=dtype).element_size())
        assert smem <= flash_triton.SMEM_BYTES and acc / (32 * c.num_warps) <= flash_triton.ACC_PER_THREAD
    monkeypatch.setenv("LMSYS_FLASH_AUTOTUNE", "0")
    assert prune(configs, args, HEAD_DIM=d) == kept[:1]


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
    _run_and_compare(*_inputs((2, 3), n_q, n_k, d, dtype, seed=d), causal, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("case", [(64, torch.bfloat16, True), (128, torch.float32, False)])
def test_gpu_every_config_is_correct(kernel, case, monkeypatch):
    """Each config the autotuner may pick, alone, on an awkward shape (the others at their defaults)."""
    d, dtype, causal = case
    tuner = {"fwd": flash_triton._attn_fwd, "dkdv": flash_triton._attn_bwd_dkdv, "dq": flash_triton._attn_bwd_dq}[kernel]
    fitting = flash_triton._prune_by_head_dim(kernel)(tuner.configs, {"Q": torch.empty(1, dtype=dtype)}, HEAD_DIM=d)
    q, k, v = _inputs((1, 2), 403, 403 if causal else 611, d, dtype, seed=7)
    monkeypatch.setenv("LMSYS_FLASH_AUTOTUNE", "0")
    for config in fitting:
        monkeypatch.setattr(tuner, "configs", [config])
        monkeypatch.setattr(tuner, "cache", {})
        try:
            _run_and_compare(q, k, v, causal, TOL[dtype])
        except AssertionError as exc:
            raise AssertionError(f"{kernel} {config}: {exc}") from None


@pytest.mark.gpu
def test_gpu_results_are_deterministic():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1500, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    runs = []
    for _ in range(2):
        out = FlashAttentionTriton.apply(q, k, v, True)
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
        out = FlashAttentionTriton.apply(q, k, v, True)  # autotuning (and do_bench's 256 MB buffer) first
        torch.autograd.grad(out, (q, k, v), do)
        del out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = FlashAttentionTriton.apply(q, k, v, True)
        torch.autograd.grad(out, (q, k, v), do)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del q, k, v, do, out
    assert 1.8 < peaks[1] / peaks[0] < 2.2, peaks


def test_rotate_configs_walks_every_fitting_config_then_restores_autotuning(monkeypatch):
    from lmsys.kernels import flash_triton as ft

    monkeypatch.delenv("LMSYS_FLASH_AUTOTUNE", raising=False)  # scripts/gpu/attention.sh sets it to 0
    prune = ft._prune_by_head_dim("dkdv")
    args = {"HEAD_DIM": 64, "Q": torch.empty(1, dtype=torch.bfloat16)}
    fitting = prune(ft.GPU_CONFIGS["dkdv"], args)
    assert len(fitting) > 1
    picked = []
    for i in range(2 * len(fitting)):
        with ft.rotate_configs(i):
            picked.extend(prune(ft.GPU_CONFIGS["dkdv"], args))
    assert picked == fitting + fitting
    assert prune(ft.GPU_CONFIGS["dkdv"], args) == fitting  # autotuning again outside


def test_rotated_configs_run_are_reported_and_leave_no_cache_behind(monkeypatch):
    """Through Triton's autotuner: two candidate configs (the interpreter list has one, and Triton
    does not prune a single config), so the rotation decides which runs."""
    from lmsys.kernels import flash_triton as ft

    two = [ft._config(16, 16, 4, 1), ft._config(32, 16, 4, 1)]
    tuner = ft._tuners()["fwd"]
    monkeypatch.setattr(tuner, "configs", two)
    q, k, v = (torch.randn(1, 2, 37, 16) for _ in range(3))
    cached = set(tuner.cache)
    for i, expected in enumerate(["16×16", "32×16"]):
        with ft.rotate_configs(i):
            out = FlashAttentionTriton.apply(q, k, v, False)
        assert ft.tiles_used("fwd") == expected
        assert set(tuner.cache) == cached  # the forced choice is not kept for these shapes
        torch.testing.assert_close(out, torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v, atol=1e-4, rtol=1e-4)
