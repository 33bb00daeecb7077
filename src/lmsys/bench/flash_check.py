"""`flash check`: a FlashAttention-2 implementation against a float64 reference, in two tiers.

- `contract`: the shapes and flags CS336's handout promises its tests use ("dimensions that are powers of
  2 and at least 16"): [batch, seq, d] with power-of-two lengths >= 16, n_queries = n_keys and not, head
  dims 16, 32, 64, 128, fp32 and bf16, causal and not. `is_causal` must be honoured, except by the PyTorch
  version of a user's adapters ("You can ignore the is_causal flag for this task"): a `yours-torch`
  output that equals its non-causal output is judged against the non-causal reference and labelled
  IGNORES_CAUSAL, not FAIL.
- `robust`: awkward shapes. Each case draws leading dims, n_queries, n_keys (mostly odd, often n_q != n_k),
  a head dim (multiples of 8: powers of two and the padded ones between), a dtype, causality and, about
  one case in three, fewer key/value heads than query heads (grouped-query or multi-query attention).

Every case runs the implementation forward and backward and compares O, the saved logsumexp L and the
three gradients with `lmsys.kernels.attention.reference_attention` computed in float64 on the CPU from the
same (rounded) inputs. Error = max |x - ref| / max(max |ref|, 1) per tensor (NaN counts as infinite).
A failed tensor that is a constant multiple of the reference (least squares, small residual) is named
with its factor ("dK is 8.0× the reference: a missing scale"); `summarize` gives each tier one line and,
from which cases fail, the shape property they share ("lengths not a multiple of 16").
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from lmsys.core.devices import DTYPE_CHOICES, torch_dtype
from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose
from lmsys.kernels import triton_interpreted
from lmsys.kernels.attention import reference_attention
from lmsys.kernels.registry import ATTENTION, spec as attention_spec
try:
    from lmsys.kernels.flash_triton import FP32_MAX_HEAD_DIM, HEAD_DIMS as KERNEL_HEAD_DIMS
except ImportError:  # no Triton (the [triton] extra): flash-torch only, and it takes every head dim
    FP32_MAX_HEAD_DIM, KERNEL_HEAD_DIMS = None, None

FLASH_IMPLS = ATTENTION.names(lambda s: s.flash)  # lmsys's own: flash-torch, flash-triton
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 2e-2}  # of relative_error
# A user's fp32 on a GPU is held to the handout's own tests (torch.testing.assert_close(rtol=1e-2, atol=1e-2)),
# not to lmsys's IEEE kernels: a compiled Triton tl.dot runs fp32 tiles as TF32 by default (about 1e-3 here),
# which those tests accept. Found on an H100: a handout-style Triton kernel failed every fp32 case at 1e-4.
# Off a GPU nothing runs as TF32 (the interpreter's dots are IEEE: a correct kernel is off by about 1e-7), so
# there a user's fp32 keeps 1e-4, and a bug worth 6e-3 (padded keys left unmasked) is not let through.
USER_FP32_TOLERANCE = 1e-2


def tolerance(dtype: str, *, user: bool = False, device="cpu") -> float:
    """The error a case of `dtype` on `device` may have: TOLERANCE, or for a user's fp32 on a GPU the
    handout's 1e-2 (TF32 dots)."""
    tf32 = user and dtype == "fp32" and str(device).startswith("cuda")
    return max(TOLERANCE[dtype], USER_FP32_TOLERANCE) if tf32 else TOLERANCE[dtype]
# The kernels take every multiple of 8 from 16 to 256 (flash_triton.HEAD_DIMS); the check cycles through the
# powers of two and the padded dims models use, in an order that mixes both from the first cases on.
HEAD_DIMS = (64, 80, 16, 128, 256, 40, 96, 32, 160, 112, 192, 24)
assert KERNEL_HEAD_DIMS is None or set(HEAD_DIMS) <= set(KERNEL_HEAD_DIMS)  # every dim drawn is one the kernels take
LEADING_DIMS = ((), (1,), (3,), (2, 3), (1, 2, 2))
MAX_LEN = 4096  # --max-len: 6 heads × 4096² float64 scores are 0.75 GiB per tensor of the reference's backward
GQA_HEADS = ((4, 1), (4, 2), (6, 3), (8, 2))  # (query heads, key/value heads)

TIERS = ("contract", "robust")
TIER_CHOICES = TIERS + ("all",)
# CS336's promise: "We will always test your code with dimensions that are powers of 2 and at least 16"
CONTRACT_HEAD_DIMS = (64, 16, 128, 32)
CONTRACT_DTYPES = ("fp32", "bf16")
CONTRACT_MIN_LEN = 16
# (causal, n_q == n_k), cycled against the head dims so that each dim meets several of them
CONTRACT_FLAGS = ((False, True), (True, True), (False, False), (True, False))
PASS, FAIL = "pass", "FAIL"
IGNORES_CAUSAL = "ignores is_causal (allowed by the handout)"
# the handout lets the PyTorch version (yours-torch) ignore is_causal; not the Triton one
MAY_IGNORE_CAUSAL = ATTENTION.names(lambda s: s.may_ignore_causal)


@dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]
    n_q: int
    n_k: int
    d: int
    causal: bool
    dtype: str
    kv_heads: int | None = None  # fewer key/value heads than lead[-1] query heads; None: as many
    tier: str = "robust"

    @property
    def leading(self) -> str:
        return "×".join(map(str, self.lead)) or "—"

    @property
    def heads(self) -> str:
        """query/key-value heads, e.g. "4/1" (— without a heads dim)."""
        if not self.lead:
            return "—"
        return f"{self.lead[-1]}/{self.kv_heads or self.lead[-1]}"


@dataclass(frozen=True)
class Pins:
    """Shapes the user fixed (--seq-len, --d-head, --batch-size, --causal/--no-causal): every case takes
    them (in turn, where several values are given); n_queries = n_keys = the pinned length."""

    seq_len: tuple[int, ...] = ()
    d_head: tuple[int, ...] = ()
    batch: tuple[int, ...] = ()
    causal: bool | None = None

    def describe(self) -> str:
        parts = [f"{name} {','.join(map(str, values))}" for name, values in
                 (("seq", self.seq_len), ("d", self.d_head), ("batch", self.batch)) if values]
        if self.causal is not None:
            parts.append("causal" if self.causal else "not causal")
        return ", ".join(parts)


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
    return not (attention_spec(impl).triton_kernel and dtype == "fp32" and d > FP32_MAX_HEAD_DIM)


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def contract_misses(pins: Pins, dtypes: list[str]) -> list[str]:
    """What of the pinned shapes and dtypes lies outside the CS336 contract (empty: the contract tier can run)."""
    misses = [f"--seq-len {n}" for n in pins.seq_len if n < CONTRACT_MIN_LEN or not _power_of_two(n)]
    misses += [f"--d-head {d}" for d in pins.d_head if d not in CONTRACT_HEAD_DIMS]
    if not any(d in CONTRACT_DTYPES for d in dtypes):
        misses.append(f"--dtype {','.join(dtypes)}")
    return misses


def plan_tiers(tier: str, pins: Pins, dtypes: list[str]) -> tuple[list[str], list[str]]:
    """(the tiers to run, notes). `--tier contract` with pins outside the contract is a user error naming
    them; the default `all` then runs the robust tier alone and says why."""
    choose(tier, TIER_CHOICES, what="--tier")
    tiers = list(TIERS) if tier == "all" else [tier]
    misses = contract_misses(pins, dtypes) if "contract" in tiers else []
    if not misses:
        return tiers, []
    why = (f"{', '.join(misses)} outside the CS336 contract (lengths powers of two >= {CONTRACT_MIN_LEN}, "
           f"head dims {', '.join(map(str, sorted(CONTRACT_HEAD_DIMS)))}, {' and '.join(CONTRACT_DTYPES)})")
    if tier == "contract":
        raise LmsysError(f"--tier contract: {why}", hint="--tier robust checks any shape")
    return ["robust"], [f"{why}: the robust tier runs alone."]


def check_pins(impl: str, pins: Pins) -> None:
    """Pinned head dims flash-triton cannot take are one line before any work."""
    for d in pins.d_head:
        attention_spec(impl).check_head_dim(d)


def _pick_dtype(impl: str, d: int, dtypes: list[str], start: int) -> str:
    for b in range(len(dtypes)):
        dtype = dtypes[(start + b) % len(dtypes)]
        if supported(impl, d, dtype):
            return dtype
    raise LmsysError(f"--d-head {d}: {impl} takes head dims above {FP32_MAX_HEAD_DIM} in fp16/bf16 only; "
                     f"add --dtype bf16")


def random_cases(count: int, *, seed: int, dtypes: list[str], max_len: int,
                 head_dims: tuple[int, ...] = HEAD_DIMS, impl: str = "flash-torch",
                 three_d: bool = False, pins: Pins = Pins()) -> list[Case]:
    """The robust tier. Head dims and dtypes cycle (every combination the implementation supports appears
    once count >= their product); lengths are mostly odd, n_q != n_k most of the time, causal about half
    of the cases. `pins` replace what they fix after the draw, so the other fields stay as without them."""
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
        if pins.seq_len:
            n_q = n_k = pins.seq_len[i % len(pins.seq_len)]
        if pins.d_head:
            d = pins.d_head[i % len(pins.d_head)]
            dtype = dtype if supported(impl, d, dtype) else _pick_dtype(impl, d, dtypes, turn)
        if pins.batch:
            lead = (pins.batch[i % len(pins.batch)],) + lead[1:]
        if pins.causal is not None:
            causal = pins.causal
        cases.append(Case(lead=lead, n_q=n_q, n_k=n_k, d=d, dtype=dtype, causal=causal, kv_heads=kv_heads))
    return cases


def contract_cases(count: int, *, seed: int, dtypes: list[str], max_len: int, impl: str = "flash-torch",
                   pins: Pins = Pins()) -> list[Case]:
    """The contract tier: [batch, seq, d] with power-of-two lengths from 16 to max_len (16 at least), head
    dims 16-128 (powers of two), fp32 and bf16 (those of `dtypes`), causal and not, n_q = n_k and not. The
    first eight cases hold every (head dim, dtype), (dtype, causal) and (causal, n_q = n_k) pair, twelve
    every (head dim, causal) pair."""
    if count < 1:
        raise LmsysError(f"--cases must be >= 1, got {count}")
    rng = random.Random(f"contract {seed}")
    lengths = list(pins.seq_len) or [2 ** p for p in range(4, 31) if 2 ** p <= max(max_len, CONTRACT_MIN_LEN)]
    dims = list(pins.d_head) or list(CONTRACT_HEAD_DIMS)
    kept = [d for d in CONTRACT_DTYPES if d in dtypes]
    cases = []
    for i in range(count):
        turn = i // len(dims) + i % len(dims)  # the dtype turns against the head dims: every pair appears
        d = dims[i % len(dims)]
        dtype = kept[turn % len(kept)] if supported(impl, d, kept[turn % len(kept)]) else _pick_dtype(impl, d, kept, turn)
        causal, same = CONTRACT_FLAGS[(i // 2 + i // 8) % len(CONTRACT_FLAGS)]
        if pins.causal is not None:
            causal = pins.causal
        n_q = rng.choice(lengths)
        others = [n for n in lengths if n != n_q]
        n_k = n_q if same or not others or pins.seq_len else rng.choice(others)
        batch = pins.batch[i % len(pins.batch)] if pins.batch else rng.randint(1, 4)
        cases.append(Case(lead=(batch,), n_q=n_q, n_k=n_k, d=d, dtype=dtype, causal=causal, tier="contract"))
    return cases


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max(max |ref|, 1): relative for tensors of magnitude >= 1, absolute below (a
    gradient that is zero by symmetry, e.g. dK with a single key, is then judged by its rounding noise)."""
    x, ref = (t.detach().to("cpu", torch.float64) for t in (x, ref))
    err = (x - ref).abs().max().item() / max(ref.abs().max().item(), 1.0)
    return err if math.isfinite(err) else math.inf


def constant_factor(x: torch.Tensor, ref: torch.Tensor, tol: float) -> float | None:
    """c when x = c·ref up to the tolerance (least squares fit; the residual relative to c·ref's size) and
    c is not 1 (0.0 when x is all zeros, a tensor never written); else None."""
    x, ref = (t.detach().to("cpu", torch.float64).flatten() for t in (x, ref))
    norm = (ref * ref).sum().item()
    if norm == 0 or not torch.isfinite(x).all():
        return None
    if x.abs().max().item() == 0:
        return 0.0  # never written: said as such, not as a factor
    c = (x * ref).sum().item() / norm
    residual = (x - c * ref).abs().max().item() / max(abs(c) * ref.abs().max().item(), 1.0)  # of x's own size
    return c if residual <= tol and abs(c - 1) > 10 * tol and abs(c) > 1e-3 else None


def factor_cause(name: str, c: float, d: int) -> str:
    """'dK is 8.0× the reference: a missing scale (1/√d, d 64)': the factor and, where it is one a FlashAttention
    bug leaves, the bug."""
    if c == 0:
        return f"{name} is all zeros"
    shown = f"{c:.1f}" if abs(c) >= 1 else f"{c:.3g}"
    root = math.sqrt(d)
    if abs(c - root) <= 0.02 * root:
        why = f"a missing scale (1/√d, d {d})"
    elif abs(c * root - 1) <= 0.02:
        why = f"the scale applied twice (1/√d, d {d})"
    elif abs(c + 1) <= 0.02:
        why = "the sign flipped"
    else:
        why = "a wrong scale"
    return f"{name} is {shown}× the reference: {why}"


def _off(tensors, errors: dict, tol: float, d: int) -> list[str]:
    """'dK [3, 7, 64]: max abs 2.33, max rel 0.501, dK is 1.5× the reference: a wrong scale' per tensor
    beyond the tolerance (or of the wrong shape)."""
    off = []
    for name, got, ref in tensors:
        if tuple(got.shape) != tuple(ref.shape):
            off.append(f"{name} shape {list(got.shape)}, expected {list(ref.shape)}")
            continue
        if errors[name] <= tol:
            continue
        diff = (got.detach().to("cpu", torch.float64) - ref.detach()).abs()
        rel = (diff / ref.detach().abs().clamp_min(1e-6)).max().item()
        text = f"{name} {list(got.shape)}: max abs {diff.max().item():.3g}, max rel {rel:.3g}"
        c = constant_factor(got, ref, tol)
        off.append(text + (f", {factor_cause(name, c, d)}" if c is not None else ""))
    return off


def _references(q, k, v, do, causal: bool):
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = reference_attention(q64, k64, v64, causal)
    grads = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())
    return o_ref.detach(), lse_ref.detach(), dict(zip(("dQ", "dK", "dV"), grads))


def _generator(seed: int, case: Case, i: int) -> torch.Generator:
    """The robust tier's inputs are the ones flash check always drew (seed, case index); the contract's
    come from a stream of their own."""
    if case.tier == "robust":
        return torch.Generator().manual_seed(seed * 100_003 + i)
    return torch.Generator().manual_seed(zlib.crc32(f"contract {seed} {i}".encode()))


def _numbered(cases: list[Case]) -> list[tuple[int, Case]]:
    """(number within its tier from 1, case)."""
    count: dict[str, int] = {}
    out = []
    for case in cases:
        count[case.tier] = count.get(case.tier, 0) + 1
        out.append((count[case.tier], case))
    return out


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


def _saved_lse(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1] and t.dtype == torch.float32]
    if len(saved) != 1:
        raise LmsysError("the implementation did not save exactly one float32 logsumexp of shape q.shape[:-1]")
    return saved[0]


def run_user_check(impl: str, cases: list[Case], *, device, seed: int, adapters: str | None) -> Iterator[dict]:
    """A user's attention on [batch, seq, d] cases: per case its tier, the error of O, L (when saved), dQ,
    dK, dV, which tensors are off (shape, max abs and relative error against float64, and the factor where
    one is a constant multiple of the reference), and whether the saved tensors follow CS336's contract (a
    separate column that does not fail the case). A causal case whose output equals the implementation's
    non-causal output is judged against the non-causal reference: `yours-torch` then passes as
    IGNORES_CAUSAL, any other FAILs saying is_causal is ignored. A function that is missing or raises
    NotImplementedError gives one `not implemented (...)` row, a kernel on an API the installed Triton
    removed one row saying what to install; any other error a FAIL row per case naming it. Triton's
    interpreter failing on the installed numpy is an InterpreterNumpyError (exit 2)."""
    from lmsys.core.imports import NotImplementedByUser
    from lmsys.kernels import triton_compat
    from lmsys.kernels.registry import resolve

    fn = resolve(impl, adapters=adapters)
    for i, (number, case) in enumerate(_numbered(cases)):
        index = number - 1
        gen = _generator(seed, case, index)
        dtype = torch_dtype(case.dtype)
        q, k, v = (torch.randn(*case.lead, n, case.d, generator=gen).to(dtype) for n in (case.n_q, case.n_k, case.n_k))
        do = torch.randn(*case.lead, case.n_q, case.d, generator=gen).to(dtype)
        q_, k_, v_ = (x.to(device).requires_grad_() for x in (q, k, v))
        key = {"impl": impl, "tier": case.tier, "case": number, "batch": case.lead[0], "n_q": case.n_q,
               "n_k": case.n_k, "d": case.d, "dtype": case.dtype, "causal": case.causal}
        empty = {**key, **dict.fromkeys(("O err", "L err", "dQ err", "dK err", "dV err")), "tol": tolerance(case.dtype, user=True, device=device),
                 "off": None, "CS336 saved L": None}  # a row that ran nothing: the same columns, in order
        try:
            out = fn(q_, k_, v_, case.causal)
            lse, contract = saved_contract(out, q_)
            dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), do.to(device))
        except NotImplementedByUser as exc:
            yield {**empty, "result": exc.status}
            return
        except triton_compat.TritonTooNew as exc:
            yield {**empty, "result": exc.status}
            return
        except LmsysError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code failed on this case: a FAIL row saying how
            too_new, numpy = triton_compat.missing_api(exc), triton_compat.numpy_mismatch(exc)
            if numpy is not None:
                raise numpy from None
            if too_new is not None:
                yield {**empty, "result": too_new.status}
                return
            yield {**empty, "off": f"raised {triton_compat.describe(exc)}", "result": FAIL}
            continue
        tol = tolerance(case.dtype, user=True, device=device)
        o_ref, lse_ref, refs = _references(q, k, v, do, case.causal)
        ignores = False
        if case.causal and relative_error(out, o_ref) > tol:  # the output of the same call without the mask?
            with torch.no_grad():
                plain = fn(q_.detach(), k_.detach(), v_.detach(), False)
            ignores = relative_error(out, plain) <= tol / 100
            if ignores and impl in MAY_IGNORE_CAUSAL:  # judged as what it computes
                o_ref, lse_ref, refs = _references(q, k, v, do, False)
        tensors = [("O", out, o_ref)] + ([("L", lse, lse_ref)] if lse is not None else []) + \
                  [(name, got, refs[name]) for name, got in (("dQ", dq), ("dK", dk), ("dV", dv))]
        errors = {name: relative_error(got, ref) for name, got, ref in tensors}
        off = _off(tensors, errors, tol, case.d)
        off += [f"{name} dtype {str(got.dtype).removeprefix('torch.')}, expected {case.dtype}"
                for name, got in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)) if got.dtype != dtype]
        result = FAIL if off else (IGNORES_CAUSAL if ignores else PASS)
        if ignores:
            off.append("is_causal ignored: judged against the non-causal reference (allowed by the handout)"
                       if impl in MAY_IGNORE_CAUSAL else
                       "is_causal ignored: the output equals the non-causal one" +
                       (" (the Triton version must honour it)" if _adapters_must_honour_causal(impl) else ""))
        yield {**key, **{f"{n} err": errors.get(n) for n in ("O", "L", "dQ", "dK", "dV")}, "tol": tol,
               "off": "; ".join(off) or "—", "CS336 saved L": contract, "result": result}


def _adapters_must_honour_causal(impl: str) -> bool:
    """An adapters' attention the handout does not let ignore is_causal (yours-triton)."""
    spec = attention_spec(impl)
    return bool(spec.adapters) and not spec.may_ignore_causal


def run_check(impl: str, cases: list[Case], *, device, seed: int) -> Iterator[dict]:
    """Yield one row per case: its tier, errors of O, L, dQ, dK, dV, the tolerance, and pass/FAIL. On a GPU,
    flash-triton runs case i with the i-th tile config that fits (untimed: a Policy pick), so a dozen cases
    exercise every config with one compile each instead of autotuning every new shape. The other levers
    are the default policy's: what users run is what is checked."""
    from lmsys.kernels import triton_compat
    from lmsys.kernels.attention import attention

    tiles = attention_spec(impl).triton_kernel
    if tiles:
        from lmsys.kernels import flash
    for i, (number, case) in enumerate(_numbered(cases)):
        gen = _generator(seed, case, number - 1)
        dtype = torch_dtype(case.dtype)

        def draw(n: int, kv: bool = False) -> torch.Tensor:
            lead = case.lead[:-1] + (case.kv_heads,) if kv and case.kv_heads else case.lead
            return torch.randn(*lead, n, case.d, generator=gen).to(dtype)

        q, k, v, do = draw(case.n_q), draw(case.n_k, kv=True), draw(case.n_k, kv=True), draw(case.n_q)
        q_, k_, v_ = (x.to(device).requires_grad_() for x in (q, k, v))
        try:
            if tiles:
                policy = replace(flash.default_policy(), pick=i)  # the levers users run, at tile pick i
                out = flash.FlashAttentionTriton.apply(q_, k_, v_, case.causal, None, policy)
            else:
                out = attention(q_, k_, v_, case.causal, impl)
            lse = _saved_lse(out, q_)
            dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), do.to(device))
        except Exception as exc:
            numpy = triton_compat.numpy_mismatch(exc)
            if numpy is not None:
                raise numpy from None
            raise
        ran = flash.kernels_ran(out) if tiles else {}

        o_ref, lse_ref, refs = _references(q, k, v, do, case.causal)
        errors = {f"{name} err": relative_error(got, ref) for name, got, ref in
                  (("O", out, o_ref), ("L", lse, lse_ref), ("dQ", dq, refs["dQ"]), ("dK", dk, refs["dK"]),
                   ("dV", dv, refs["dV"]))}
        tol = TOLERANCE[case.dtype]
        ok = out.dtype == dtype and dq.dtype == dtype and all(e <= tol for e in errors.values())
        yield {"tier": case.tier, "case": number, "leading dims": case.leading, "heads q/kv": case.heads,
               "n_q": case.n_q, "n_k": case.n_k, "d": case.d, "dtype": case.dtype, "causal": case.causal, **errors,
               **({"tiles fwd/dkdv/dq": " / ".join(  # "fwd / bwd" where a one-launch backward ran
                   ran.get(kernel, "—") for kernel in (("fwd", "bwd") if "bwd" in ran else ("fwd", "dkdv+dq")
                                                       if "dkdv+dq" in ran else ("fwd", "dkdv", "dq")))}
                  if tiles else {}),
               "tol": tol, "result": PASS if ok else FAIL}


# ------------------------------------------------------------------------------------------ the verdict

def counts_as_failed(result: str) -> bool:
    """FAIL, or a status that kept the check from running (a Triton too new); not a pass, not the
    handout's allowance, not the course's `not implemented` starting code."""
    return result not in (PASS, IGNORES_CAUSAL) and not result.startswith("not implemented")


def _features(row: dict) -> dict[str, bool]:
    """Shape properties a failure pattern is described by, the most telling first."""
    n_q, n_k, d = row["n_q"], row["n_k"], row["d"]
    found = {}
    for t in (16, 32, 64, 128):
        found[f"lengths not a multiple of {t}"] = bool(n_q % t or n_k % t)
        found[f"key lengths not a multiple of {t}"] = bool(n_k % t)
        found[f"query lengths not a multiple of {t}"] = bool(n_q % t)
    found.update({
        "causal cases": bool(row["causal"]),
        "non-causal cases": not row["causal"],
        "n_queries ≠ n_keys": n_q != n_k,
        "n_queries > n_keys": n_q > n_k,
        "n_queries < n_keys": n_q < n_k,
        "lengths below 16": min(n_q, n_k) < 16,
        "head dims not a power of two": not _power_of_two(d),
        "head dims above 64": d > 64,
        "head dims above 128": d > 128,
        "head dims below 64": d < 64,
        "fp32 cases": row["dtype"] == "fp32",
        "bf16 cases": row["dtype"] == "bf16",
        "fp16 cases": row["dtype"] == "fp16",
        "fp16 and bf16 cases": row["dtype"] != "fp32",
    })
    heads = row.get("heads q/kv")
    if heads and heads != "—":
        hq, hkv = heads.split("/")
        found["grouped-query cases"] = hq != hkv
    return found


def shared_property(failed: list[dict], passed: list[dict]) -> str | None:
    """The shape property (or pair of them, 'A or B') that every failed case has and no passed one, judged
    over all of an implementation's cases; failing that, the one every failed case has and the fewest
    passed ones (a quarter of them at most: a causal case can pass with padded keys it never sees). None
    when there is none, or nothing passed to tell them apart."""
    if not failed or not passed:
        return None
    fails, passes = [_features(r) for r in failed], [_features(r) for r in passed]
    names = [n for n in fails[0] if all(n in f for f in fails + passes)]
    covering = [n for n in names if all(f[n] for f in fails)]
    pairs = [f"{a} or {b}" for i, a in enumerate(names) for b in names[i + 1:]
             if all(f[a] or f[b] for f in fails) and not (a in covering or b in covering)]

    def holds(name: str, f: dict) -> bool:
        return any(f[part] for part in name.split(" or "))

    candidates = covering + pairs  # single properties first, in the order of _features
    if not candidates:
        return None
    best = min(candidates, key=lambda n: sum(holds(n, p) for p in passes))  # min keeps the first of equals
    return best if sum(holds(best, p) for p in passes) <= len(passes) // 4 else None


def _explain(failed: list[dict], passed: list[dict]) -> str:
    """What went wrong, grouped by kind (tensors off; each exception), each with the shape property its
    cases share: 'lengths not a multiple of 16: O, L, dQ, dK, dV off; head dims not a power of two: raised
    ValueError: ...'."""
    groups: dict[str, list[dict]] = {}
    for row in failed:
        raised = [part for part in str(row.get("off") or "").split("; ") if part.startswith("raised ")]
        key = raised[0] if raised else ""
        groups.setdefault(key if len(key) <= 160 else key[:157] + "...", []).append(row)
    parts = []
    for key, rows in sorted(groups.items(), key=lambda kv: kv[0] != ""):  # the tensors off first
        what = key or _what_failed(rows)
        where = shared_property(rows, passed)
        parts.append(f"{where}: {what}" if where else what)
    return "; ".join(parts)


_FACTOR = re.compile(r"(?P<name>\w+) is (?P<c>-?[\d.]+(?:e[-+]?\d+)?)× the reference: (?P<why>[^(;]*?)(?: \((?P<note>[^)]*)\))?$")


def _row_causes(row: dict) -> list[str]:
    """A row's causes: 'dK is 8.0× the reference: a missing scale (1/√d, d 64)', 'raised X: ...',
    'is_causal ignored: ...'."""
    out = []
    for part in str(row.get("off") or "").split("; "):
        at = max(part.find("× the reference"), part.find(" is all zeros"))
        if at >= 0:
            start = part.rfind(", ", 0, at)
            out.append(part[start + 2:] if start >= 0 else part)
        elif part.startswith(("raised ", "is_causal ignored")):
            out.append(part)
    return out


def _what_failed(failed: list[dict]) -> str:
    """What the failed rows say: the cause they all share (one factor, an exception), else the tensors off."""
    causes = [_row_causes(r) for r in failed]
    common = [c for c in causes[0] if all(c in cs for cs in causes[1:])] if causes else []
    if common:
        return "; ".join(common)
    # the same tensor off by the same kind of factor, its value varying (√d at different head dims)
    kinds = [{(m["name"], m["why"]): (float(m["c"]), m["note"]) for c in cs if (m := _FACTOR.match(c))}
             for cs in causes]
    shared = set(kinds[0]).intersection(*kinds[1:]) if kinds else set()
    if shared:
        parts = []
        for name, why in sorted(shared):
            values = sorted(k[(name, why)][0] for k in kinds)
            note = kinds[0][(name, why)][1]
            span = "–".join(f"{c:.1f}" if abs(c) >= 1 else f"{c:.3g}" for c in dict.fromkeys((values[0], values[-1])))
            note = note.split(",")[0] if note else None
            parts.append(f"{name} is {span}× the reference: {why}" + (f" ({note})" if note else ""))
        return "; ".join(parts)
    tensors = []
    for row in failed:
        for part in str(row.get("off") or "").split("; "):
            name = part.split(" ")[0]
            if name in ("O", "L", "dQ", "dK", "dV") and name not in tensors:
                tensors.append(name)
    raised = sorted({part.split(":")[0] for row in failed for part in str(row.get("off") or "").split("; ")
                     if part.startswith("raised ")})
    parts = ([", ".join(sorted(tensors, key="O L dQ dK dV".split().index)) + " off"] if tensors else []) + raised
    return "; ".join(parts) or "FAIL"


def summarize(rows: list[dict], impl: str, *, contract_gates: bool) -> tuple[list[str], bool]:
    """One line per tier that ran for `impl` ("yours-torch: passes the CS336 contract 12/12"; "robust 3/12
    pass: FAIL on lengths not a multiple of 16: O, L, dQ, dK, dV off") and whether it fails the run: on
    the contract tier alone when `contract_gates` and that tier ran (a user's adapters: the handout's
    promises), else on any tier."""
    mine = [r for r in rows if r.get("impl", impl) == impl]
    status = [r for r in mine if r["result"].startswith("not implemented") or r.get("off") is None
              and r["result"] not in (PASS, FAIL, IGNORES_CAUSAL)]
    if status:  # one row that ran nothing: not implemented, or a Triton without the API
        result = status[0]["result"]
        word = "" if result.startswith("not implemented") else "not checked: "
        return [f"{impl}: {word}{result}."], counts_as_failed(result)
    lines, failing = [], {}
    passed_all = [r for r in mine if not counts_as_failed(r["result"])]
    for tier in TIERS:
        these = [r for r in mine if r["tier"] == tier]
        if not these:
            continue
        failed = [r for r in these if counts_as_failed(r["result"])]
        ok = len(these) - len(failed)
        ignored = sum(r["result"] == IGNORES_CAUSAL for r in these)
        failing[tier] = bool(failed)
        if tier == "contract":
            head = (f"{impl}: passes the CS336 contract {ok}/{len(these)}" if not failed
                    else f"{impl}: FAILS the CS336 contract {ok}/{len(these)}")
        else:
            head = f"{impl}: robust {ok}/{len(these)}"
        extra = f" ({ignored} ignore is_causal, allowed by the handout)" if ignored else ""
        if failed:
            extra += ": " + _explain(failed, passed_all)
        lines.append(head + extra + ".")
    if contract_gates and "contract" in failing:
        return lines, failing["contract"]
    return lines, any(failing.values())
