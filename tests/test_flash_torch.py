"""FlashAttentionTorch (the tiled PyTorch FlashAttention-2) against float64 on awkward shapes."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from lmsys.core.errors import LmsysError
from lmsys.kernels.attention import attention, naive_attention
from lmsys.bench.flash_check import reference_attention, relative_error
from lmsys.kernels.flash_torch import FlashAttentionTorch, flash_forward

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _rel(x, ref):
    """Relative error for tensors of magnitude >= 1, absolute below (zero gradients, e.g. one key)."""
    return relative_error(x, ref)


def _run_and_compare(q, k, v, causal, tol, **tiles):
    """Forward + backward through FlashAttentionTorch, every output checked against float64."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = FlashAttentionTorch.apply(q, k, v, causal, *tiles.values())
    lse = out.grad_fn.saved_tensors[4]
    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = reference_attention(q64, k64, v64, causal)
    refs = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())
    assert out.dtype == q.dtype and dq.dtype == q.dtype and lse.dtype == torch.float32
    for name, got, ref in zip(("O", "L", "dQ", "dK", "dV"), (out, lse, dq, dk, dv), (o_ref, lse_ref, *refs)):
        assert got.shape == ref.shape, name
        assert _rel(got, ref) < tol, f"{name}: {_rel(got, ref):.2e}"


def test_reference_matches_sdpa_in_float64():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 19, 16, generator=g, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        o, lse = reference_attention(q, k, v, causal)
        torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        s = q @ k.transpose(-1, -2) / math.sqrt(16)
        if not causal:
            torch.testing.assert_close(lse, torch.logsumexp(s, -1))


# (leading dims, n_q, n_k, d, causal, dtype): odd lengths, n_q != n_k, batch 1, several leading dims
CASES = [
    ((2,), 37, 53, 16, False, torch.float32),
    ((1, 2), 70, 70, 32, True, torch.float32),
    ((), 45, 29, 64, True, torch.bfloat16),
    ((2, 1, 2), 33, 81, 128, True, torch.float16),
    ((1,), 1, 17, 64, False, torch.float32),
    ((3,), 16, 16, 16, True, torch.float32),
    ((1, 1), 29, 45, 256, False, torch.bfloat16),
]


@pytest.mark.parametrize("lead,n_q,n_k,d,causal,dtype", CASES)
def test_matches_float64(lead, n_q, n_k, d, causal, dtype):
    g = torch.Generator().manual_seed(hash((lead, n_q, n_k, d)) % 2**31)
    q = torch.randn(*lead, n_q, d, generator=g).to(dtype)
    k, v = (torch.randn(*lead, n_k, d, generator=g).to(dtype) for _ in range(2))
    _run_and_compare(q, k, v, causal, TOL[dtype], q_tile=16, k_tile=8)


def test_fresh_random_shapes():
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    for _ in range(4):
        causal = rng.random() < 0.5
        n_q, n_k = rng.randint(1, 90), rng.randint(1, 90)
        lead = rng.choice([(), (1,), (2, 3)])
        d = rng.choice([16, 32, 64, 128])
        q = torch.randn(*lead, n_q, d)
        k, v = torch.randn(*lead, n_k, d), torch.randn(*lead, n_k, d)
        try:
            _run_and_compare(q, k, v, causal, 1e-5, q_tile=rng.choice([8, 16, 32]), k_tile=rng.choice([8, 16, 64]))
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {lead} {n_q}x{n_k} d{d} causal={causal}: {exc}") from None


def test_saves_exactly_q_k_v_o_and_fp32_logsumexp():
    q = torch.randn(2, 3, 21, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 3, 13, 16, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 3, 13, 16, dtype=torch.bfloat16, requires_grad=True)
    out = FlashAttentionTorch.apply(q, k, v)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 5
    assert saved[0] is q and saved[1] is k and saved[2] is v
    assert torch.equal(saved[3], out)
    assert saved[4].shape == q.shape[:-1] and saved[4].dtype == torch.float32
    assert [t.shape for t in saved].count(q.shape[:-1]) == 1


def test_causal_mask_hides_later_keys():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    out = FlashAttentionTorch.apply(q, k, v, True, 16, 16)
    torch.testing.assert_close(out, naive_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)
    v2 = v.clone()
    v2[..., 25:, :] += 100.0  # keys after query 24 must not change rows 0..24
    out2 = FlashAttentionTorch.apply(q, k, v2, True, 16, 16)
    torch.testing.assert_close(out2[..., :25, :], out[..., :25, :])
    assert not torch.allclose(out2[..., 25:, :], out[..., 25:, :])
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :])  # query 0 sees key 0 only


def test_non_contiguous_inputs_and_dispatch():
    torch.manual_seed(0)
    base = torch.randn(2, 33, 3, 64)  # [B, S, H, d] viewed as [B, H, S, d]
    q, k, v = (base.transpose(1, 2) + i for i in range(3))
    assert not q.is_contiguous()
    out = attention(q, k, v, is_causal=True, impl="flash-torch")
    torch.testing.assert_close(out, naive_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shapes,needle", [
    (((2, 10, 16), (3, 10, 16), (3, 10, 16)), "q has 2 heads (dim -3), k and v 3"),
    (((1, 6, 10, 16), (1, 4, 10, 16), (1, 4, 10, 16)), "multiple of the key/value heads"),
    (((2, 4, 10, 16), (1, 2, 10, 16), (1, 2, 10, 16)), "same leading dims"),
    (((2, 10, 16), (2, 10, 32), (2, 10, 32)), "same leading dims and d"),
    (((2, 10, 16), (2, 9, 16), (2, 10, 16)), "same leading dims"),
    (((10,), (10,), (10,)), "[..., n, d]"),
    (((2, 0, 16), (2, 4, 16), (2, 4, 16)), "empty"),
])
def test_shape_errors_are_one_line(shapes, needle):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(LmsysError) as info:
        flash_forward(q, k, v)
    assert needle in str(info.value) and "flash-torch" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("lead,hq,hkv,n_q,n_k,d,causal", [
    ((2,), 4, 1, 37, 29, 80, True),   # multi-query
    ((), 8, 2, 21, 45, 40, False),    # Hkv = Hq/4
    ((1,), 6, 3, 33, 33, 24, True),
])
def test_grouped_query_attention_matches_float64(lead, hq, hkv, n_q, n_k, d, causal):
    """k, v with fewer heads than q, not repeated: dK, dV summed over each group of query heads."""
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    q = torch.randn(*lead, hq, n_q, d, generator=g)
    k, v = (torch.randn(*lead, hkv, n_k, d, generator=g) for _ in range(2))
    _run_and_compare(q, k, v, causal, TOL[torch.float32], q_tile=16, k_tile=8)


def test_dtype_mismatch_is_an_error():
    q = torch.randn(4, 16)
    with pytest.raises(LmsysError, match="share a dtype"):
        flash_forward(q, q.double(), q)
