"""NVTX ranges (no-op without CUDA, push/pop when enabled) and the annotated attention."""

import math

import pytest
import torch

from lmsys.kernels.attention import IMPLS, attention
from lmsys.profiling import nvtx
from lmsys.profiling.phases import PROFILER_NAMES


def reference_attention(q, k, v, is_causal):
    """Row by row in float64, independent of the tensor formulation: query i sees keys j <= i."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    n_q, n_k = q.shape[-2], k.shape[-2]
    for i in range(n_q):
        keys = i + 1 if is_causal else n_k
        s = (q[..., i : i + 1, :] @ k[..., :keys, :].transpose(-1, -2)) / math.sqrt(q.shape[-1])
        out[..., i, :] = (torch.softmax(s, dim=-1) @ v[..., :keys, :]).squeeze(-2)
    return out


def test_range_is_a_no_op_without_cuda_and_works_as_decorator():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour")

    @nvtx.nvtx_range("DECORATED")
    def f(x):
        return x + 1

    with nvtx.nvtx_range("OUTER", synchronize=True) as r:
        assert f(1) == 2
    assert r.name == "OUTER" and not r._pushed


def test_range_pushes_and_pops_when_nvtx_is_available(monkeypatch):
    calls = []
    monkeypatch.setattr(nvtx, "nvtx_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))

    @nvtx.nvtx_range("F")
    def f():
        with nvtx.nvtx_range("INNER"):
            pass

    f()
    with pytest.raises(ValueError):
        with nvtx.nvtx_range("RAISES"):
            raise ValueError
    assert calls == [("push", "F"), ("push", "INNER"), ("pop",), ("pop",), ("push", "RAISES"), ("pop",)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("n_q,n_k", [(7, 7), (5, 9)])
def test_annotated_attention_matches_a_float64_reference(is_causal, n_q, n_k):
    if is_causal and n_q > n_k:
        pytest.skip("top-left causal needs n_q <= n_k")
    g = torch.Generator().manual_seed(n_q * 10 + n_k + is_causal)
    q = torch.randn(2, 3, n_q, 16, generator=g)
    k = torch.randn(2, 3, n_k, 16, generator=g)
    v = torch.randn(2, 3, n_k, 16, generator=g)
    got = attention(q, k, v, is_causal=is_causal, impl="annotated")
    torch.testing.assert_close(got.double(), reference_attention(q, k, v, is_causal), atol=1e-5, rtol=1e-5)
    if n_q == n_k:  # and against PyTorch's own op
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        torch.testing.assert_close(got, sdpa, atol=1e-5, rtol=1e-5)


def test_annotated_is_registered_and_marks_its_three_parts_for_torch_profiler():
    assert "annotated" in IMPLS
    q = torch.randn(1, 2, 8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention(q, q, q, is_causal=True, impl="annotated")
    names = [e.name for e in prof.events()]
    for part in nvtx.ATTENTION_RANGES:
        assert names.count(part) == 1, part


def test_run_step_opens_the_phase_ranges_of_each_mode():
    from lmsys.train import Workload, build_train_step, random_batch, run_step
    from lmsys.model.config import PRESETS

    cfg = PRESETS["tiny"].with_overrides(context_length=16, num_layers=1)
    workload = Workload(cfg, batch_size=1)
    step = build_train_step(workload, torch.device("cpu"))
    x, y = random_batch(workload, torch.device("cpu"))
    for mode, expected in [("fwd", ["FWD_STEP"]), ("fwd-bwd", ["FWD_STEP", "BWD_STEP"]),
                           ("train", ["FWD_STEP", "BWD_STEP", "OPTIM_STEP"])]:
        opened = []

        def range_fn(name, opened=opened):
            opened.append(name)
            return nvtx.nvtx_range(name)

        run_step(step, x, y, mode=mode, range_fn=range_fn, names=PROFILER_NAMES)
        assert opened == expected
