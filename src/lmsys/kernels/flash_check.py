"""`flash check`: a FlashAttention-2 implementation against a float64 reference on random awkward shapes.

Each case draws leading dims, n_queries, n_keys (mostly odd, often n_q != n_k), a head dim, a dtype and
causality, runs the implementation forward and backward, and compares O, the saved logsumexp L and the
three gradients with `reference_attention` computed in float64 on the CPU from the same (rounded) inputs.
Error = max |x - ref| / max(max |ref|, 1) per tensor (NaN counts as infinite).
"""

from __future__ import annotations

import math
import random
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch

from lmsys.core.devices import DTYPE_CHOICES, torch_dtype
from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose
from lmsys.kernels import triton_interpreted
from lmsys.kernels.flash_triton import FP32_HEAD_DIMS, HEAD_DIMS  # the head dims checked: the kernels' own

FLASH_IMPLS = ("flash-torch", "flash-triton")
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 2e-2}  # of relative_error
LEADING_DIMS = ((), (1,), (3,), (2, 3), (1, 2, 2))


@dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]
    n_q: int
    n_k: int
    d: int
    causal: bool
    dtype: str

    @property
    def leading(self) -> str:
        return "×".join(map(str, self.lead)) or "—"


def reference_attention(q, k, v, is_causal: bool):
    """(o, L) in float64 on the CPU with the whole score matrix: softmax(q kᵀ/√d) v, top-left causal."""
    q, k, v = (x.to("cpu", torch.float64) for x in (q, k, v))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def default_max_len(device) -> int:
    """Long enough for several tiles of the kernels' block sizes (16-32 in the interpreter, 64-128 on a GPU)."""
    return 300 if device.type == "cuda" else 80


def default_impl(device) -> str:
    """flash-triton where it can run (a GPU, or Triton's interpreter), else flash-torch."""
    interpreted = triton_interpreted()
    return "flash-triton" if device.type == "cuda" or interpreted else "flash-torch"


def check_dtype(name: str) -> str:
    return choose(name, DTYPE_CHOICES, what="--dtype")


def device_dtypes(device) -> list[str]:
    """Every dtype the implementations run on this device (bf16 only where the GPU has it)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ["fp32", "fp16"]
    return list(DTYPE_CHOICES)


def check_impl(impl: str) -> str:
    return choose(impl, FLASH_IMPLS, what="--impl")


def supported(impl: str, d: int, dtype: str) -> bool:
    """The kernels' own tables: flash-triton's head dims (narrower in fp32); flash-torch takes everything."""
    if impl != "flash-triton":
        return True
    return d in (FP32_HEAD_DIMS if dtype == "fp32" else HEAD_DIMS)


def random_cases(count: int, *, seed: int, dtypes: list[str], max_len: int,
                 head_dims: tuple[int, ...] = HEAD_DIMS, impl: str = "flash-torch") -> list[Case]:
    """Head dims and dtypes cycle (every combination the implementation supports appears once count >=
    their product); lengths are mostly odd, n_q != n_k most of the time, causal about half of the cases."""
    if count < 1:
        raise LmsysError(f"--cases must be >= 1, got {count}")
    if max_len < 1:
        raise LmsysError(f"--max-len must be >= 1, got {max_len}")
    rng = random.Random(seed)

    def length() -> int:
        n = rng.randint(1, max_len)
        return n if n % 2 or n == max_len else n + 1  # odd unless it would pass max_len

    cases = []
    for i in range(count):
        causal = rng.random() < 0.5
        n_q = length()
        n_k = n_q if causal and rng.random() < 0.5 else length()
        turn = i % len(head_dims) + i // len(head_dims)
        d, dtype = next((head_dims[(i + a) % len(head_dims)], dtypes[(turn + b) % len(dtypes)])
                        for a in range(len(head_dims)) for b in range(len(dtypes))
                        if supported(impl, head_dims[(i + a) % len(head_dims)], dtypes[(turn + b) % len(dtypes)]))
        cases.append(Case(lead=rng.choice(LEADING_DIMS), n_q=n_q, n_k=n_k, d=d, dtype=dtype, causal=causal))
    return cases


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max(max |ref|, 1): relative for tensors of magnitude >= 1, absolute below (a
    gradient that is zero by symmetry, e.g. dK with a single key, is then judged by its rounding noise)."""
    err = (x.detach().to("cpu", torch.float64) - ref.detach()).abs().max().item()
    err = err / max(ref.detach().abs().max().item(), 1.0)
    return err if math.isfinite(err) else math.inf


def _saved_lse(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1] and t.dtype == torch.float32]
    if len(saved) != 1:
        raise LmsysError("the implementation did not save exactly one float32 logsumexp of shape q.shape[:-1]")
    return saved[0]


def run_check(impl: str, cases: list[Case], *, device, seed: int) -> Iterator[dict]:
    """Yield one row per case: errors of O, L, dQ, dK, dV, the tolerance, and pass/FAIL."""
    from lmsys.kernels.attention import attention

    tiles = impl == "flash-triton"
    if tiles:
        from lmsys.kernels import flash_triton
    for i, case in enumerate(cases):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        dtype = torch_dtype(case.dtype)

        def draw(n: int) -> torch.Tensor:
            return torch.randn(*case.lead, n, case.d, generator=gen).to(dtype)

        q, k, v, do = draw(case.n_q), draw(case.n_k), draw(case.n_k), draw(case.n_q)
        q_, k_, v_ = (x.to(device).requires_grad_() for x in (q, k, v))
        with flash_triton.rotate_configs(i) if tiles else nullcontext():
            out = attention(q_, k_, v_, case.causal, impl)
            lse = _saved_lse(out, q_)
            dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), do.to(device))

        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        o_ref, lse_ref = reference_attention(q64, k64, v64, case.causal)
        dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())

        errors = {f"{name} err": relative_error(got, ref) for name, got, ref in
                  (("O", out, o_ref), ("L", lse, lse_ref), ("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref))}
        tol = TOLERANCE[case.dtype]
        ok = out.dtype == dtype and dq.dtype == dtype and all(e <= tol for e in errors.values())
        yield {"case": i + 1, "leading dims": case.leading, "n_q": case.n_q, "n_k": case.n_k, "d": case.d,
               "dtype": case.dtype, "causal": case.causal, **errors,
               **({"tiles fwd/dkdv/dq": " / ".join(flash_triton.tiles_used(kernel)
                                                    for kernel in ("fwd", "dkdv", "dq"))} if tiles else {}),
               "tol": tol, "result": "pass" if ok else "FAIL"}
