"""The fast path's own kernels against PyTorch: chunked cross-entropy and master-weight AdamW."""

import pytest
import torch
import torch.nn.functional as F

from lmsys.kernels.adamw import MasterWeightAdamW, adamw_update_
from lmsys.kernels.cross_entropy import chunked_cross_entropy


@pytest.mark.parametrize("T, V, chunk_rows", [(37, 50, 5), (64, 128, 64), (1, 7, 1), (33, 10, 100)])
def test_chunked_cross_entropy_matches_float64_reference(T, V, chunk_rows):
    torch.manual_seed(T * V)
    h = torch.randn(T, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, 24, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (T,))
    ref = F.cross_entropy(h @ w.T, t)
    gh, gw = torch.autograd.grad(ref, (h, w))
    out = chunked_cross_entropy(h, w, t, chunk_bytes=4 * V * chunk_rows)
    oh, ow = torch.autograd.grad(out, (h, w))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(oh, gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ow, gw, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: chunked_cross_entropy(a, b, t, chunk_bytes=4 * V * chunk_rows), (h, w))


def test_chunked_cross_entropy_under_bf16_autocast_keeps_dtypes():
    torch.manual_seed(0)
    h = torch.randn(2, 9, 32, requires_grad=True)          # fp32 residual stream, as in the model
    w = torch.randn(40, 32, requires_grad=True)            # fp32 weight
    t = torch.randint(0, 40, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_cross_entropy(h, w, t, chunk_bytes=4 * 40 * 4)
        ref = F.cross_entropy((h @ w.T).flatten(0, 1), t.flatten())
    assert out.dtype == torch.float32
    out.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(out, ref.float(), rtol=2e-2, atol=2e-2)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 1000, 4096 * 2 + 3])
@pytest.mark.parametrize("programs", [None, 1, 2])
def test_adamw_update_matches_torch_adamw(n, device, programs):
    """Triton kernel (interpreter on a CPU) vs torch.optim.AdamW on the fp32 master, several steps; with
    `programs`, a grid smaller than the tile count loops (n = 2 tiles + 3 = 3 tiles: with 2 programs,
    program 0 does tiles 0 and 2)."""
    torch.manual_seed(n)
    master_ref = torch.randn(n, dtype=torch.float32, device=device, requires_grad=True)
    opt = torch.optim.AdamW([master_ref], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    param = master_ref.detach().to(torch.bfloat16)
    master = master_ref.detach().clone()
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    for step in range(1, 4):
        g = torch.randn(n, device=device).to(torch.bfloat16)
        master_ref.grad = g.float()
        opt.step()
        adamw_update_(param, g, master, m, v, step=step, lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6,
                      weight_decay=0.1, programs=programs)
    torch.testing.assert_close(master, master_ref.detach(), rtol=1e-5, atol=1e-6)
    # GPUs round fp32 -> bf16 to nearest even; Triton's interpreter truncates (one bf16 ulp, 2^-7 relative).
    ulp = 0 if device == "cuda" else 2**-7
    torch.testing.assert_close(param.float(), master_ref.detach().to(torch.bfloat16).float(), rtol=ulp, atol=0)


def test_master_weight_adamw_trains_bf16_model_like_fp32_adamw():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    low = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    low.load_state_dict(ref.state_dict())
    low.to(torch.bfloat16)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = MasterWeightAdamW(low.parameters(), lr=1e-2)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for _ in range(20):
        for model, o, xx in ((ref, opt_ref, x), (low, opt, x.bfloat16())):
            o.zero_grad()
            F.cross_entropy(model(xx).float(), y).backward()
            o.step()
    for p_ref, p in zip(ref.parameters(), low.parameters()):
        master = opt.state[p]["master"]
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        torch.testing.assert_close(master, p_ref.detach(), rtol=0.05, atol=0.02)
        torch.testing.assert_close(p.float(), master, rtol=1e-2, atol=1e-2)
