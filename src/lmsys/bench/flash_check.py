"""`flash check`: a FlashAttention-2 implementation against a float64 reference on random awkward shapes.

Each case draws leading dims, n_queries, n_keys (mostly odd, often n_q != n_k), a head dim (multiples of 8:
powers of two and the padded ones between), a dtype, causality and, about one case in three, fewer key/value
heads than query heads (grouped-query or multi-query attention), runs the implementation forward and backward, and compares O, the saved logsumexp L and the
three gradients with `lmsys.kernels.attention.reference_attention` computed in float64 on the CPU from the same (rounded) inputs.
Error = max |x - ref| / max(max |ref|, 1) per tensor (NaN counts as infinite).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from lmsys.core.devices import DTYPE_CHOICES, torch_dtype
from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose
from lmsys.kernels import triton_interpreted
from lmsys.kernels.attention import reference_attention
try:
    from lmsys.kernels.flash_triton import FP32_MAX_HEAD_DIM, HEAD_DIMS as KERNEL_HEAD_DIMS
except ImportError:  # no Triton (the [triton] extra): flash-torch only, and it takes every head dim
    FP32_MAX_HEAD_DIM, KERNEL_HEAD_DIMS = None, None

FLASH_IMPLS = ("flash-torch", "flash-triton")
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 2e-2}  # of relative_error
# The kernels take every multiple of 8 from 16 to 256 (flash_triton.HEAD_DIMS); the check cycles through the
# powers of two and the padded dims models use, in an order that mixes both from the first cases on.
HEAD_DIMS = (64, 80, 16, 128, 256, 40, 96, 32, 160, 112, 192, 24)
assert KERNEL_HEAD_DIMS is None or set(HEAD_DIMS) <= set(KERNEL_HEAD_DIMS)  # every dim drawn is one the kernels take
LEADING_DIMS = ((), (1,), (3,), (2, 3), (1, 2, 2))
MAX_LEN = 4096  # --max-len: 6 heads × 4096² float64 scores are 0.75 GiB per tensor of the reference's backward
GQA_HEADS = ((4, 1), (4, 2), (6, 3), (8, 2))  # (query heads, key/value heads)


@dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]
    n_q: int
    n_k: int
    d: int
    causal: bool
    dtype: str
    kv_heads: int | None = None  # fewer key/value heads than lead[-1] query heads; None: as many

    @property
    def leading(self) -> str:
        return "×".join(map(str, self.lead)) or "—"

    @property
    def heads(self) -> str:
        """query/key-value heads, e.g. "4/1" (— without a heads dim)."""
        if not self.lead:
            return "—"
        return f"{self.lead[-1]}/{self.kv_heads or self.lead[-1]}"


def default_max_len(device) -> int:
    """Long enough for several tiles of the kernels' block sizes (16-32 in the interpreter, 64-128 on a GPU)."""
    return 300 if device.type == "cuda" else 80


def default_impl(device) -> str:
    """flash-triton where it can run (a GPU, or Triton's interpreter), else flash-torch."""
    interpreted = triton_interpreted()
    if KERNEL_HEAD_DIMS is None:
        return "flash-torch"
    return "flash-triton" if device.type == "cuda" or interpreted else "flash-torch"


def check_dtype(name: str) -> str:
    return choose(name, DTYPE_CHOICES, what="--dtype")


def device_dtypes(device) -> list[str]:
    """Every dtype the implementations run on this device (bf16 only where the GPU has it)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ["fp32", "fp16"]
    return list(DTYPE_CHOICES)


def check_impl(impl: str, *, adapters: str | None = None) -> str:
    """flash-torch, flash-triton, or a user's: yours-torch / yours-triton (--adapters), pkg.module:Name."""
    from lmsys.core.imports import is_import_path
    from lmsys.kernels.registry import ADAPTER_NAMES, check_name

    if impl in FLASH_IMPLS or is_import_path(impl):
        return impl
    if impl in ADAPTER_NAMES:
        return check_name(impl, adapters=adapters, what="--impl")
    raise LmsysError(f"--impl must be one of {', '.join(FLASH_IMPLS)}, {', '.join(ADAPTER_NAMES)} (with --adapters) "
                     f"or pkg.module:Name, not {impl!r}")


def is_user(impl: str) -> bool:
    return impl not in FLASH_IMPLS


def supported(impl: str, d: int, dtype: str) -> bool:
    """flash-triton takes head dims past FP32_MAX_HEAD_DIM in fp16/bf16 only; flash-torch takes everything."""
    return not (impl == "flash-triton" and dtype == "fp32" and d > FP32_MAX_HEAD_DIM)


def random_cases(count: int, *, seed: int, dtypes: list[str], max_len: int,
                 head_dims: tuple[int, ...] = HEAD_DIMS, impl: str = "flash-torch",
                 three_d: bool = False) -> list[Case]:
    """Head dims and dtypes cycle (every combination the implementation supports appears once count >=
    their product); lengths are mostly odd, n_q != n_k most of the time, causal about half of the cases."""
    if count < 1:
        raise LmsysError(f"--cases must be >= 1, got {count}")
    if max_len < 1:
        raise LmsysError(f"--max-len must be >= 1, got {max_len}")
    if max_len > MAX_LEN:  # the float64 reference on the CPU: n_q × n_k scores for up to 6 leading heads
        from lmsys.core.parsing import format_bytes

        scores = 6 * max_len * max_len * 8
        raise LmsysError(f"--max-len {max_len} is over the limit of {MAX_LEN}: the float64 reference runs on the "
                         f"CPU and would hold {format_bytes(scores)} of scores per tensor of its backward",
                         hint=f"--max-len {MAX_LEN} or less (the kernels' tiles are 16-128 long: a few hundred "
                              "covers every boundary case)")
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
        lead, kv_heads = rng.choice(LEADING_DIMS), None
        if three_d:  # a user's attention: CS336's [batch, seq, d]
            lead = (rng.randint(1, 3),)
        elif i % 3 == 2:  # grouped-query: [batch, Hq] leading dims, k and v with Hkv heads
            hq, kv_heads = rng.choice(GQA_HEADS)
            lead = (rng.randint(1, 2), hq)
        cases.append(Case(lead=lead, n_q=n_q, n_k=n_k, d=d, dtype=dtype, causal=causal, kv_heads=kv_heads))
    return cases


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max(max |ref|, 1): relative for tensors of magnitude >= 1, absolute below (a
    gradient that is zero by symmetry, e.g. dK with a single key, is then judged by its rounding noise)."""
    x, ref = (t.detach().to("cpu", torch.float64) for t in (x, ref))
    err = (x - ref).abs().max().item() / max(ref.abs().max().item(), 1.0)
    return err if math.isfinite(err) else math.inf


def _saved_lse(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1] and t.dtype == torch.float32]
    if len(saved) != 1:
        raise LmsysError("the implementation did not save exactly one float32 logsumexp of shape q.shape[:-1]")
    return saved[0]


def saved_contract(out, q) -> tuple[torch.Tensor | None, str]:
    """(the saved logsumexp L or None, whether the saved tensors follow CS336's contract: exactly one
    fp32 L of shape q.shape[:-1] beside q, k, v, o)."""
    try:
        saved = list(out.grad_fn.saved_tensors)
    except (AttributeError, RuntimeError):
        return None, "no (no autograd.Function)"
    lse = [t for t in saved if t.shape == q.shape[:-1] and t.dtype == torch.float32]
    others = [t for t in saved if not any(t is l for l in lse)]
    if len(lse) == 1 and len(others) == 4:
        return lse[0], "yes"
    shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in saved)
    return (lse[0] if len(lse) == 1 else None), f"no (saved {shapes or 'nothing'})"


def run_user_check(impl: str, cases: list[Case], *, device, seed: int, adapters: str | None) -> Iterator[dict]:
    """A user's attention on [batch, seq, d] cases: per case the error of O, L (when saved), dQ, dK, dV,
    which tensors are off (shape, max abs and relative error against float64), and whether the saved
    tensors follow CS336's contract (a separate column that does not fail the case). A function that is
    missing or raises NotImplementedError gives one `not implemented (...)` row; any other error a FAIL
    row per case naming it."""
    from lmsys.core.imports import NotImplementedByUser
    from lmsys.kernels.registry import resolve

    fn = resolve(impl, adapters=adapters)
    for i, case in enumerate(cases):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        dtype = torch_dtype(case.dtype)
        q, k, v = (torch.randn(*case.lead, n, case.d, generator=gen).to(dtype) for n in (case.n_q, case.n_k, case.n_k))
        do = torch.randn(*case.lead, case.n_q, case.d, generator=gen).to(dtype)
        q_, k_, v_ = (x.to(device).requires_grad_() for x in (q, k, v))
        key = {"impl": impl, "case": i + 1, "batch": case.lead[0], "n_q": case.n_q, "n_k": case.n_k, "d": case.d,
               "dtype": case.dtype, "causal": case.causal}
        empty = {**key, **dict.fromkeys(("O err", "L err", "dQ err", "dK err", "dV err")), "tol": TOLERANCE[case.dtype],
                 "off": None, "CS336 saved L": None}  # a row that ran nothing: the same columns, in order
        try:
            out = fn(q_, k_, v_, case.causal)
            lse, contract = saved_contract(out, q_)
            dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), do.to(device))
        except NotImplementedByUser as exc:
            yield {**empty, "result": exc.status}
            return
        except Exception as exc:  # noqa: BLE001 - the user's code failed on this case: a FAIL row saying how
            yield {**empty, "off": f"raised {type(exc).__name__}: {' '.join(str(exc).split())}", "result": "FAIL"}
            continue
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        o_ref, lse_ref = reference_attention(q64, k64, v64, case.causal)
        refs = dict(zip(("dQ", "dK", "dV"), torch.autograd.grad(o_ref, (q64, k64, v64), do.double())))
        tensors = [("O", out, o_ref)] + ([("L", lse, lse_ref)] if lse is not None else []) + \
                  [(name, got, refs[name]) for name, got in (("dQ", dq), ("dK", dk), ("dV", dv))]
        errors = {name: relative_error(got, ref) for name, got, ref in tensors}
        tol = TOLERANCE[case.dtype]
        off = []
        for name, got, ref in tensors:
            if not errors[name] <= tol or tuple(got.shape) != tuple(ref.shape):
                if tuple(got.shape) != tuple(ref.shape):
                    off.append(f"{name} shape {list(got.shape)}, expected {list(ref.shape)}")
                    continue
                diff = (got.detach().to("cpu", torch.float64) - ref.detach()).abs()
                rel = (diff / ref.detach().abs().clamp_min(1e-6)).max().item()
                off.append(f"{name} {list(got.shape)}: max abs {diff.max().item():.3g}, max rel {rel:.3g}")
        off += [f"{name} dtype {str(got.dtype).removeprefix('torch.')}, expected {case.dtype}"
                for name, got in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)) if got.dtype != dtype]
        ok = not off
        yield {**key, **{f"{n} err": errors.get(n) for n in ("O", "L", "dQ", "dK", "dV")}, "tol": tol,
               "off": "; ".join(off) or "—", "CS336 saved L": contract, "result": "pass" if ok else "FAIL"}


def run_check(impl: str, cases: list[Case], *, device, seed: int) -> Iterator[dict]:
    """Yield one row per case: errors of O, L, dQ, dK, dV, the tolerance, and pass/FAIL. On a GPU,
    flash-triton runs case i with the i-th tile config that fits (untimed: a Policy pick), so a dozen cases
    exercise every config with one compile each instead of autotuning every new shape. The other levers
    are the default policy's: what users run is what is checked."""
    from lmsys.kernels.attention import attention

    tiles = impl == "flash-triton"
    if tiles:
        from lmsys.kernels import flash
    for i, case in enumerate(cases):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        dtype = torch_dtype(case.dtype)

        def draw(n: int, kv: bool = False) -> torch.Tensor:
            lead = case.lead[:-1] + (case.kv_heads,) if kv and case.kv_heads else case.lead
            return torch.randn(*lead, n, case.d, generator=gen).to(dtype)

        q, k, v, do = draw(case.n_q), draw(case.n_k, kv=True), draw(case.n_k, kv=True), draw(case.n_q)
        q_, k_, v_ = (x.to(device).requires_grad_() for x in (q, k, v))
        if tiles:
            policy = replace(flash.default_policy(), pick=i)  # the levers users run, at tile pick i
            out = flash.FlashAttentionTriton.apply(q_, k_, v_, case.causal, None, policy)
        else:
            out = attention(q_, k_, v_, case.causal, impl)
        lse = _saved_lse(out, q_)
        dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), do.to(device))
        ran = flash.kernels_ran(out) if tiles else {}

        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        o_ref, lse_ref = reference_attention(q64, k64, v64, case.causal)
        dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())

        errors = {f"{name} err": relative_error(got, ref) for name, got, ref in
                  (("O", out, o_ref), ("L", lse, lse_ref), ("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref))}
        tol = TOLERANCE[case.dtype]
        ok = out.dtype == dtype and dq.dtype == dtype and all(e <= tol for e in errors.values())
        yield {"case": i + 1, "leading dims": case.leading, "heads q/kv": case.heads, "n_q": case.n_q, "n_k": case.n_k, "d": case.d,
               "dtype": case.dtype, "causal": case.causal, **errors,
               **({"tiles fwd/dkdv/dq": " / ".join(  # "fwd / bwd" where the Gluon one-launch backward ran
                   ran.get(kernel, "—") for kernel in (("fwd", "bwd") if "bwd" in ran
                                                       else ("fwd", "dkdv", "dq")))} if tiles else {}),
               "tol": tol, "result": "pass" if ok else "FAIL"}
