"""What both time profilers (nsys, torch.profiler) produce, and the table rows made from it.

A `TimeProfile` holds range times (host-side duration of each NVTX/record_function range and the GPU
kernel time inside it), the top kernels (or, on a CPU, operators) overall and per range, and for nsys
the CUDA API calls. The row builders below turn it into the tables `lmsys profile nsys` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmsys.profiling.nvtx import ATTENTION_RANGES, ATTN_AV_MATMUL, ATTN_QK_MATMUL, ATTN_SOFTMAX
from lmsys.profiling.phases import STEP_RANGES


@dataclass
class Timed:
    """A kernel, an operator or an API call: how often it ran and for how long in all (ns)."""

    name: str
    count: int
    total_ns: float


@dataclass
class RangeTime:
    name: str
    instances: int
    total_ns: float  # host-side duration, summed over instances (phases synchronise before they end)
    device_ns: float | None = None  # GPU kernel time attributed to the range (None: not measured)
    kernels: int | None = None  # kernel launches attributed to the range


@dataclass
class TimeProfile:
    engine: str  # "nsys" | "torch"
    unit: str  # "kernel" (GPU) | "operator" (CPU: self CPU time of PyTorch operators)
    ranges: list[RangeTime] = field(default_factory=list)
    top: list[Timed] = field(default_factory=list)  # overall, sorted by total time
    by_range: dict[str, list[Timed]] = field(default_factory=dict)  # per range, sorted
    api: list[Timed] = field(default_factory=list)  # CUDA API calls (nsys)
    files: dict[str, str] = field(default_factory=dict)  # what was written, by role
    commands: list[str] = field(default_factory=list)  # the exact command lines that ran
    notes: list[str] = field(default_factory=list)

    def range(self, name: str) -> RangeTime | None:
        return next((r for r in self.ranges if r.name == name), None)


def aggregate(items: list[Timed]) -> list[Timed]:
    """Merge items of the same name; sort by total time, largest first."""
    merged: dict[str, Timed] = {}
    for it in items:
        m = merged.setdefault(it.name, Timed(it.name, 0, 0.0))
        m.count += it.count
        m.total_ns += it.total_ns
    return sorted(merged.values(), key=lambda t: (-t.total_ns, t.name))


def short_kernel_name(name: str, width: int = 90) -> str:
    """'void at::native::foo<float>(int, T1)' -> 'at::native::foo<float>': no return type, no
    parameter list, cut to `width` characters."""
    text = name.strip().replace("(anonymous namespace)::", "")
    if text.startswith("void "):
        text = text[5:]
    depth = 0
    for i, ch in enumerate(text):
        if ch in "<[":
            depth += 1
        elif ch in ">]":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0 and i > 0:
            text = text[:i]
            break
    return text if len(text) <= width else text[: width - 1] + "…"


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6


def _order(ranges: list[RangeTime]) -> list[RangeTime]:
    """Step phases first (in step order), then attention parts, then the rest by total time."""
    rank = {name: i for i, name in enumerate((*STEP_RANGES, *ATTENTION_RANGES))}
    return sorted(ranges, key=lambda r: (rank.get(r.name, len(rank)), -r.total_ns, r.name))


def range_rows(profile: TimeProfile) -> list[dict]:
    """One row per range: instances, total and mean host time, share of the step, GPU kernel time."""
    step_total = sum(r.total_ns for r in profile.ranges if r.name in STEP_RANGES)
    has_device = any(r.device_ns is not None for r in profile.ranges)
    rows = []
    for r in _order(profile.ranges):
        row = {
            "range": r.name,
            "instances": r.instances,
            "total ms": _ms(r.total_ns),
            "avg ms": _ms(r.total_ns / r.instances) if r.instances else None,
            # share of the step: this phase's time over the three phases' time
            "% of step": 100 * r.total_ns / step_total if r.name in STEP_RANGES and step_total else None,
        }
        if has_device:
            row["GPU kernel ms"] = _ms(r.device_ns)
            row["kernels"] = r.kernels
        rows.append(row)
    return rows


def top_rows(items: list[Timed], *, unit: str, top: int) -> list[dict]:
    """The `top` largest items with their share of all items' time (the whole list, not the top)."""
    total = sum(t.total_ns for t in items)
    time_col = "self CPU ms" if unit == "operator" else "total ms"
    rows = []
    for i, t in enumerate(items[:top], 1):
        rows.append({
            "#": i,
            unit: short_kernel_name(t.name),
            "calls": t.count,
            time_col: _ms(t.total_ns),
            "avg µs": t.total_ns / t.count / 1e3 if t.count else None,
            "%": 100 * t.total_ns / total if total else None,  # share of the table's scope
        })
    return rows


# FLOPs of the annotated attention's parts, per call, for q, k, v of shape [B, H, S, d] (naive math:
# the full S×S score matrix is computed even when causal). Conventions, stated where printed:
# a matmul [S, d] @ [d, S] is 2·S·S·d multiply-adds counted as two FLOPs each; softmax counts 5 FLOPs
# per score (max, subtract, exp, sum, divide).
SOFTMAX_FLOPS_PER_SCORE = 5
SPLIT_FLOP_NOTE = ("GFLOP: 2·B·H·S²·d per matmul (the naive math computes the full S×S scores even when causal); "
                   "softmax counted as 5 FLOPs per score (max, subtract, exp, sum, divide).")


def attention_part_flops(part: str, *, batch: int, heads: int, seq_len: int, d_head: int) -> float:
    scores = batch * heads * seq_len * seq_len
    if part in (ATTN_QK_MATMUL, ATTN_AV_MATMUL):
        return 2.0 * scores * d_head
    if part == ATTN_SOFTMAX:
        return float(SOFTMAX_FLOPS_PER_SCORE * scores)
    raise ValueError(part)


def split_rows(profile: TimeProfile, *, shape: tuple[int, int, int, int] | None = None) -> list[dict]:
    """Matmul vs softmax inside the annotated attention. Time is the GPU kernel time inside each range
    when the engine measured it, else the range's host time. `shape` = (B, H, S, d) adds FLOPs."""
    parts = [(name, profile.range(name)) for name in ATTENTION_RANGES]
    if not any(r for _, r in parts):
        return []

    def time_ns(r: RangeTime | None) -> float:
        if r is None:
            return 0.0
        return r.device_ns if r.device_ns is not None else r.total_ns

    total = sum(time_ns(r) for _, r in parts)
    labels = {ATTN_QK_MATMUL: "QKᵀ matmul (+ scale)", ATTN_SOFTMAX: "mask + softmax", ATTN_AV_MATMUL: "P·V matmul"}
    rows = []

    def row(label: str, names: tuple[str, ...]) -> dict:
        rs = [profile.range(n) for n in names]
        t = sum(time_ns(r) for r in rs)
        calls = sum(r.instances for r in rs if r) if len(names) == 1 else None
        out = {"part": label, "calls": calls, "time ms": t / 1e6, "% of attention": 100 * t / total if total else None}
        if shape is not None:
            b, h, s, d = shape
            flops = sum(attention_part_flops(n, batch=b, heads=h, seq_len=s, d_head=d) * (r.instances if r else 0)
                        for n, r in zip(names, rs))
            out["GFLOP"] = flops / 1e9
            out["GFLOP/s"] = flops / (t * 1e-9) / 1e9 if t else None
        return out

    for name, _ in parts:
        rows.append(row(labels[name], (name,)))
    rows.append(row("matmuls (QKᵀ + P·V)", (ATTN_QK_MATMUL, ATTN_AV_MATMUL)))
    return rows


# The attention a step ran, read from its kernel (GPU) or operator (CPU) names: (label, name fragments), the
# first label with a fragment in any name wins (the specific kernels before the softmax of a hand-written one).
ATTENTION_SIGNS = (
    ("sdpa: cuDNN", ("_scaled_dot_product_cudnn_attention", "cudnn_generated_fort_native_sdpa", "sdpa_fprop")),
    ("sdpa: flash", ("_scaled_dot_product_flash_attention", "pytorch_flash::", "flash_fwd_kernel")),
    ("sdpa: memory-efficient", ("_scaled_dot_product_efficient_attention", "fmha_cutlass", "efficient_attention")),
    ("sdpa: math", ("_scaled_dot_product_attention_math",)),
    ("flash-attn (Dao's package)", ("flash_attn", "flash::flash_fwd")),
    ("Triton flash kernel", ("_attn_fwd", "attn_fwd")),
    ("naive: matmul + softmax", ("aten::softmax", "aten::_softmax", "softmax_warp_forward", "SoftMaxForward")),
)


def attention_seen(profile: TimeProfile) -> str | None:
    """'sdpa: flash (aten::_scaled_dot_product_flash_attention_for_cpu)': the attention the profiled step
    ran, named from its kernels or operators, with the name that shows it; None when none shows (a kernel
    lmsys does not know). A softmax counts only outside cross-entropy's log-softmax."""
    names = [t.name for t in profile.top]
    for label, fragments in ATTENTION_SIGNS:
        for name in names:
            if any(f in name for f in fragments) and "log_softmax" not in name.lower() \
                    and "logsoftmax" not in name.lower():
                return f"{label} ({short_kernel_name(name, 60)})"
    return None
