"""The FLOP conventions and MFU, checked against counts made another way (by hand, or by torch)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmsys.core import devices
from lmsys.core.flops import attention_flops
from lmsys.kernels.attention import naive_attention

# A config small enough to run in a second on a CPU, with every FLOP written out by hand below.
CONFIG = ("--d-model", "64", "--d-ff", "128", "--layers", "2", "--heads", "2", "--vocab-size", "100",
          "--context-length", "16", "--batch-size", "2")
# Per token, forward: the matmul weights of 2 layers (Q, K, V, O: 4·64·64 = 16384; SwiGLU: 3·64·128 =
# 24576) plus the LM head (64·100 = 6400) = 2·40960 + 6400 = 88320, at 2 FLOPs per weight = 176640;
# attention's QKᵀ and PV: 4·S·d_model·layers = 4·16·64·2 = 8192. Forward per token: 184832; 32 tokens.
FWD_FLOPS = 184832 * 32  # 5_914_624
FWD_BWD_FLOPS = 3 * FWD_FLOPS  # backward = 2× forward: 17_743_872
GPU = "NVIDIA H100 80GB HBM3"  # stated peaks (core.hardware.GPUS["H100 SXM"], dense): fp32 67, TF32 494.5 TFLOP/s
PEAK = {False: 67.0, True: 494.5}


@pytest.mark.parametrize("tf32", [False, True])
def test_bench_e2e_reports_mfu_from_the_closed_form_and_the_right_peak(lmsys, monkeypatch, tf32):
    # The same path a GPU run takes: peak_tflops(device, dtype, tf32=...) looks the peak up by the GPU's name.
    monkeypatch.setattr(devices, "gpu_name", lambda device: GPU)
    args = ("bench", "e2e", "--size", "tiny", *CONFIG, "--mode", "all", "--steps", "2", "--warmup", "0",
            "--device", "cpu", "--format", "json") + (("--tf32",) if tf32 else ())
    r = lmsys(*args)
    assert r.code == 0, r.err
    rows = {row["mode"]: row for row in json.loads(r.out)["rows"]}
    expected_flops = {"fwd": FWD_FLOPS, "fwd-bwd": FWD_BWD_FLOPS, "train": FWD_BWD_FLOPS}
    for mode, flops in expected_flops.items():
        seconds = rows[mode]["ms/step"]["mean"] / 1e3
        by_hand = 100 * flops / seconds / (PEAK[tf32] * 1e12)
        assert rows[mode]["MFU %"] == pytest.approx(by_hand, rel=1e-6), mode


def test_peak_lookup_by_name_dtype_and_tf32():
    assert devices.peak_tflops_for(GPU, "fp32", tf32=False) == 67.0
    assert devices.peak_tflops_for(GPU, "fp32", tf32=True) == 494.5
    assert devices.peak_tflops_for(GPU, "bf16", tf32=True) == 989.5  # TF32 only changes fp32
    assert devices.peak_tflops_for("NVIDIA A100-SXM4-80GB", "fp32", tf32=False) == 19.5
    assert devices.peak_tflops_for("Some Future GPU", "bf16", tf32=False) is None
    assert devices.peak_tflops_for(None, "fp32", tf32=False) is None
    assert devices.peak_tflops(torch.device("cpu"), "fp32") is None


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("b, h, s, d", [(2, 3, 24, 16), (1, 2, 40, 8)])
def test_attention_flop_convention_against_torch_flop_counter(b, h, s, d):
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    fwd = _counted(lambda: naive_attention(q, k, v))
    assert attention_flops(batch=b, heads=h, n_queries=s, n_keys=s, d_head=d, causal=False, direction="fwd") == fwd

    out = naive_attention(q, k, v)
    grad = torch.randn_like(out)
    bwd = _counted(lambda: out.backward(grad))
    # The naive backward runs four matmuls (2× forward); FlashAttention-2 also recomputes QKᵀ in backward
    # (one more matmul, half a forward): the convention's 2.5×.
    assert bwd == 2 * fwd
    recompute_qk = fwd / 2
    assert attention_flops(batch=b, heads=h, n_queries=s, n_keys=s, d_head=d, causal=False,
                           direction="bwd") == bwd + recompute_qk


def test_causal_convention_is_half_of_the_lower_triangle_counted_row_by_row():
    b, h, s, d = 1, 2, 32, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))

    def causal_rows():  # query i against keys 0..i only: what a causal kernel computes
        for i in range(s):
            naive_attention(q[..., i:i + 1, :], k[..., :i + 1, :], v[..., :i + 1, :])

    counted = _counted(causal_rows)  # 4·b·h·d·(1 + 2 + ... + s) = 4·b·h·d·s(s+1)/2
    convention = attention_flops(batch=b, heads=h, n_queries=s, n_keys=s, d_head=d, causal=True, direction="fwd")
    assert counted == pytest.approx(convention * (s + 1) / s)  # half the square, plus the diagonal


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_model_flops_count_the_matmul_weights_of_the_model_with_grouped_query_attention(kv_heads):
    """2 FLOPs per matmul weight per token forward (plus attention's two products): the weights counted
    from the built model's Linear layers, so k and v shrink with fewer key/value heads."""
    from lmsys.core.flops import model_flops
    from lmsys.model.config import get_config
    from lmsys.model.transformer import Linear, TransformerLM

    cfg = get_config("tiny").with_overrides(num_kv_heads=kv_heads, context_length=32)
    model = TransformerLM(cfg, device="cpu")
    linear = sum(p.numel() for m in model.modules() if isinstance(m, Linear) for p in m.parameters())
    attention = 4 * cfg.context_length * cfg.d_model * cfg.num_layers
    assert model_flops(cfg, batch_size=1, seq_len=cfg.context_length, backward=False) == pytest.approx(
        (2 * linear + attention) * cfg.context_length)
