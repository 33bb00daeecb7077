"""`bench attention`: time attention implementations forward and backward over a sweep of shapes.

For each (impl, batch, heads, d_head, seq) the inputs are random [batch, heads, seq, d_head] tensors (k and v
with `kv_heads` heads instead when given: grouped-query attention; FLOPs are the same); after
`warmup` untimed steps, `steps` steps each time one forward and one backward (torch.autograd.grad of the
output against a random dO) with the one timer (CUDA events). Memory, from PyTorch's allocator on a GPU:
the peak during a forward, what is allocated just before the backward (inputs + saved tensors + output),
and the peak during the backward. Every row is checked: the first step's output and gradients against a
float64 reference (`check_step`), and a wrong one gets status `wrong (O err 3.1e-01)` (exit 1). `host µs`: after the timed steps, the median over min(HOST_CALLS, steps) calls
of the host time to issue one forward and backward (the Python and launch overhead, the GPU idle at the
start of each: no queue to wait on); where it comes near `fwd+bwd ms`, the row is host-bound. An
out-of-memory configuration yields a row with status 'oom' and the sweep goes on. TFLOP/s follow lmsys.core.flops.attention_flops: 4·b·h·s²·d forward, 2.5× that backward,
halved when causal.

Levers: with `policies`, flash-triton runs once under its default policy and once per variant, each a
lmsys.kernels.flash.Policy with some fields changed (`--policy tma=true,persistent=true`); every
row then names its policy. Fields are typed from the dataclass itself, whichever fields it has.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from typing import Iterator

from lmsys.core import progress
from lmsys.core.errors import LmsysError
from lmsys.core.files import save_figure
from lmsys.core.flops import attention_flops
from lmsys.core.parsing import MiB, choose
from lmsys.core.results import MeanStd
from lmsys.core.timing import RegionTimer, synchronize
from lmsys.kernels.registry import spec as attention_spec

HOST_CALLS = 30  # calls whose issue time gives `host µs` (median)


@dataclass(frozen=True)
class Sweep:
    impls: tuple[str, ...]
    batch: tuple[int, ...]
    heads: tuple[int, ...]
    d_head: tuple[int, ...]
    seq_len: tuple[int, ...]
    dtype: str
    causal: bool
    warmup: int
    steps: int
    kv_heads: int | None = None  # key/value heads (grouped-query); None: as many as query heads
    policies: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()  # (label, Policy field changes)

    @property
    def flash_variants(self) -> tuple[tuple[str, dict | None], ...]:
        """(policy label, changes) per flash-triton row: the default policy first (None: no label)."""
        if not self.policies:
            return ((None, None),)
        return (("default", {}),) + tuple((label, dict(changes)) for label, changes in self.policies)

    @property
    def size(self) -> int:
        runs = sum(len(self.flash_variants) if attention_spec(impl).triton_kernel else 1 for impl in self.impls)
        return runs * len(self.batch) * len(self.heads) * len(self.d_head) * len(self.seq_len)

    def describe(self) -> str:
        kv = f", kv heads {self.kv_heads}" if self.kv_heads else ""
        return (f"{self.dtype}, {'causal' if self.causal else 'not causal'}, batch {_list(self.batch)}, "
                f"heads {_list(self.heads)}{kv}, warmup {self.warmup}, {self.steps} timed forward+backward steps")


def _list(values) -> str:
    return ",".join(map(str, values))


# The seed's sweep (CS336 assignment 2, attention benchmarking): batch 8, one head, no mask, fp32.
SEED = Sweep(impls=("naive", "compiled", "flash-triton"), batch=(8,), heads=(1,), d_head=(16, 32, 64, 128),
             seq_len=(256, 1024, 4096, 8192, 16384), dtype="fp32", causal=False, warmup=10, steps=100)
# On a CPU, when no size is given: small enough to finish in seconds.
CPU_DEFAULT = replace(SEED, impls=("naive", "flash-torch"), batch=(1,), d_head=(16, 64), seq_len=(128, 256),
                      warmup=1, steps=5)
CPU_IMPLS = ("naive", "compiled", "sdpa", "sdpa-math", "flash-torch")
PRESETS = {
    # The CS336 leaderboard shape: bf16, causal, batch 1, 16 heads, seq 16384, d 64.
    "leaderboard": replace(SEED, impls=("sdpa-flash", "sdpa-cudnn", "flash-triton"), batch=(1,), heads=(16,),
                           d_head=(64,), seq_len=(16384,), dtype="bf16", causal=True),
}


# Policy fields that are not levers: configs holds triton.Config objects, ran is written by the launchers.
NOT_LEVERS = ("configs", "ran")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def split_policy(text: str) -> list[tuple[str, str]]:
    """'tma=true,gluon_copy_min_keys={128: 8192}' -> [(key, value text)], split at the commas outside
    brackets; only the syntax is checked here (torch-free: the command calls it before importing torch)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    pairs = []
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key.strip().isidentifier() or not value.strip():
            raise LmsysError(f"--policy: expected FIELD=VALUE[,FIELD=VALUE...], got {part or text!r}")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _policy_value(key: str, text: str, hint) -> object:
    """`text` as a value of the Policy field `key` annotated `hint` (bool, int, float, str, None, or a
    Python literal for containers)."""
    import ast
    import types
    import typing

    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds = [o for o in options if o is not type(None)]
    if text.lower() == "none" and len(kinds) < len(options):
        return None
    for kind in kinds:
        if kind is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
        elif kind in (int, float, str):
            try:
                return kind(text)
            except ValueError:
                pass
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, typing.get_origin(kind) or kind):
                return value
    names = " | ".join(getattr(o, "__name__", str(o)).replace("NoneType", "none") for o in options)
    raise LmsysError(f"--policy {key}={text}: not a value of {key} ({names})")


def policy_variants(texts: list[str]) -> tuple[tuple[str, tuple[tuple[str, object], ...]], ...]:
    """Each --policy text as (label, ((field, typed value), ...)), checked against the fields of
    lmsys.kernels.flash.Policy (a field given twice in one text: the later value)."""
    import dataclasses
    import typing

    from lmsys.kernels.flash import Policy

    hints = typing.get_type_hints(Policy)
    levers = [f.name for f in dataclasses.fields(Policy) if f.init and f.name not in NOT_LEVERS]
    variants = []
    for text in texts:
        changes = {}  # a field given twice takes its later value
        for key, value in split_policy(text):
            if key not in levers:
                raise LmsysError(f"--policy: {key!r} is not a lever of flash_triton.Policy (one of: "
                                 f"{', '.join(levers)})")
            changes[key] = _policy_value(key, value, hints[key])
        label = ",".join(f"{key}={value}" for key, value in changes.items())
        variants.append((label, tuple(changes.items())))
    return tuple(variants)


def resolve_sweep(*, device, preset: str | None = None, impls: list[str] | None = None,
                  batch: list[int] | None = None, heads: list[int] | None = None, d_head: list[int] | None = None,
                  seq_len: list[int] | None = None, dtype: str | None = None, causal: bool | None = None,
                  warmup: int | None = None, steps: int | None = None,
                  kv_heads: int | None = None, policies: list[str] | None = None,
                  adapters: str | None = None) -> tuple[Sweep, list[str]]:
    """The sweep to run: the preset (or the seed's, or a small CPU one) with every given option on top.
    Returns it with notes saying what was chosen for the user."""
    from lmsys.core.devices import check_dtype_for_device
    from lmsys.kernels.attention import check_impl

    notes = []
    if preset is not None:
        base = PRESETS[choose(preset, PRESETS, what="--preset")]
    elif device.type == "cpu" and not any([batch, heads, d_head, seq_len]):
        base = CPU_DEFAULT
        notes.append("CPU without sizes: a small sweep (batch 1, d 16,64, seq 128,256, 5 steps) that finishes "
                     "in seconds; give --d-head/--seq-len/--batch for others, and use a GPU for the seed's sweep.")
    else:
        base = SEED
    if device.type == "cpu" and not impls:
        kept = tuple(i for i in base.impls if i in CPU_IMPLS) or CPU_DEFAULT.impls
        if kept != base.impls:
            notes.append(f"CPU: implementations {_list(kept)} (GPU-only ones dropped; choose with --impl).")
        base = replace(base, impls=kept)
    if adapters is not None and not impls:  # your rows beside lmsys's, as ddp train adds its four
        yours = ("yours-torch", "yours-triton") if device.type == "cuda" else ("yours-torch",)
        if device.type != "cuda":
            notes.append("CPU: --adapters times yours-torch (yours-triton on a GPU, or ask for it with --impl).")
        base = replace(base, impls=base.impls + yours)
    sweep = replace(
        base,
        impls=tuple(dict.fromkeys(impls)) if impls else base.impls,
        batch=tuple(batch or base.batch), heads=tuple(heads or base.heads),
        d_head=tuple(d_head or base.d_head), seq_len=tuple(seq_len or base.seq_len),
        dtype=dtype or base.dtype, causal=base.causal if causal is None else causal,
        warmup=base.warmup if warmup is None else warmup, steps=base.steps if steps is None else steps,
        kv_heads=kv_heads, policies=policy_variants(policies) if policies else (),
    )
    if sweep.policies and not any(attention_spec(i).triton_kernel for i in sweep.impls):
        raise LmsysError("--policy changes how flash-triton runs: add --impl flash-triton")
    from lmsys.kernels.registry import check_name, resolve

    for name in sweep.impls:  # a user's is loaded now: a file that does not import is one line before any work
        resolve(check_name(name, adapters=adapters, what="--impl"), adapters=adapters)
        check_impl(name)
    check_dtype_for_device(sweep.dtype, device)
    for what, value, minimum in (("--warmup", sweep.warmup, 0), ("--steps", sweep.steps, 1)):
        if value < minimum:
            raise LmsysError(f"{what} must be >= {minimum}, got {value}")
    for what, values in (("--batch-size", sweep.batch), ("--heads", sweep.heads), ("--d-head", sweep.d_head),
                         ("--context-length", sweep.seq_len)):
        if min(values) < 1:
            raise LmsysError(f"{what} must be >= 1, got {min(values)}")
    if kv_heads is not None:
        bad = [h for h in sweep.heads if kv_heads < 1 or h % kv_heads]
        if bad:
            raise LmsysError(f"--kv-heads {kv_heads} must divide every --heads value (not {_list(bad)})")
    for name in sweep.impls:  # what the spec needs of head dims and the device (flash-triton: its kernels')
        for d in sweep.d_head:
            check_impl(name, d_head=d)
        attention_spec(name).check_device(device)
    return sweep, notes


def run_attention(sweep: Sweep, *, device) -> Iterator[dict]:
    """Yield one row per (impl, flash-triton policy, batch, heads, d_head, seq_len), in that nesting order."""
    for impl in sweep.impls:
        variants = sweep.flash_variants if attention_spec(impl).triton_kernel else ((None, None),)
        for (label, changes), batch, heads, d, seq in product(variants, sweep.batch, sweep.heads, sweep.d_head,
                                                              sweep.seq_len):
            policy = {"policy": label} if sweep.policies else {}
            key = {"impl": impl, **policy, "batch": batch, "heads": heads, "d": d, "seq": seq}
            yield _row(key, sweep, device, changes)


def describe_sweeps(sweeps: list[Sweep]) -> str:
    """Sweep.describe() of sweeps that differ only in dtype as one: 'fp32,bf16, not causal, batch 8, ...'."""
    rest = {s.describe().removeprefix(s.dtype) for s in sweeps}
    if len(rest) == 1:
        return ",".join(s.dtype for s in sweeps) + rest.pop()
    return " | ".join(s.describe() for s in sweeps)


def run_sweeps(sweeps: list[Sweep], *, device) -> Iterator[dict]:
    """`run_attention` over each sweep in turn (one per --dtype); with several, rows lead with a dtype column."""
    for sweep in sweeps:
        for row in run_attention(sweep, device=device):
            yield {"dtype": sweep.dtype, **row} if len(sweeps) > 1 else row


def _row(key: dict, sweep: Sweep, device, changes: dict | None) -> dict:
    """The measured row of `key` (impl, batch, heads, d, seq), or its status: OOM, unsupported, a user's
    `not implemented (...)`, the error the user's attention raised, or the Triton API it needs that the
    installed Triton lacks. Triton's interpreter failing on the installed numpy ends the command (exit 2)."""
    from lmsys.core.devices import free_memory, is_oom
    from lmsys.core.imports import NotImplementedByUser
    from lmsys.kernels import triton_compat
    from lmsys.kernels.registry import USER

    measured = ("fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd TFLOP/s", "peak fwd MiB",
                "before bwd MiB", "peak bwd MiB", "host µs")
    key = {**key, **dict.fromkeys(measured)}  # a status row has the measured columns too: status stays last
    try:
        row = {**key, **_measure(key["impl"], key["batch"], key["heads"], key["d"], key["seq"], sweep, device,
                                 policy=changes)}
    except NotImplementedByUser as exc:
        row = {**key, "status": exc.status}
    except triton_compat.TritonTooNew as exc:  # nothing measured, and not the user's code: an error, said whole
        row = {**key, "status": f"error: {exc.status}"}
    except LmsysError:
        raise
    except Exception as exc:  # noqa: BLE001 - OOM and unavailable backends; a user's failing code
        numpy, too_new = triton_compat.numpy_mismatch(exc), triton_compat.missing_api(exc)
        if numpy is not None:  # Triton's interpreter on this numpy: nothing Triton will run
            raise numpy from None
        if too_new is not None and key["impl"] in USER:
            row = {**key, "status": f"error: {too_new.status}"}
        elif is_oom(exc):
            row = {**key, "status": "OOM"}
        elif _unavailable(exc):
            row = {**key, "status": "unsupported"}
        elif key["impl"] in USER:  # the row says why; the others run, and the command exits 1 after the table
            row = {**key, "status": f"error: {type(exc).__name__}: {' '.join(str(exc).split())}"}
        else:
            raise
    free_memory(device)
    return row


def _unavailable(exc: BaseException) -> bool:
    """SDPA pinned to a backend that cannot take these inputs ('No available kernel'), or one this
    build or device does not have at all ('No viable backend', e.g. sdpa-flash on a CPU)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("no available kernel" in text or "no viable backend" in text)


def _measure(impl: str, batch: int, heads: int, d: int, seq: int, sweep: Sweep, device, *,
             policy: dict | None = None) -> dict:
    """Time one configuration; `policy`: flash-triton's default Policy with these fields changed."""
    import torch

    from lmsys.core.devices import current_memory, peak_memory, reset_peak_memory, torch_dtype
    from lmsys.kernels.attention import attention

    dtype = torch_dtype(sweep.dtype)
    shape = (batch, heads, seq, d)
    kv_shape = (batch, sweep.kv_heads or heads, seq, d)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(kv_shape, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    do = torch.randn(shape, device=device, dtype=dtype)
    inputs = (q, k, v)

    if policy is None:
        def forward():
            return attention(q, k, v, sweep.causal, impl)
    else:  # the call attention()'s flash-triton makes, under the changed policy
        from lmsys.kernels.flash import FlashAttentionTriton, default_policy

        changed = replace(default_policy(), **policy)

        def forward():
            return FlashAttentionTriton.apply(q, k, v, sweep.causal, None, changed)

    progress.plan_steps(sweep.warmup + sweep.steps, "fwd+bwd steps")
    from lmsys.kernels.registry import USER

    verdict = check_step(forward(), inputs, do, sweep.causal, sweep.dtype, user=impl in USER)  # the first step
    for _ in range(sweep.warmup):  # compilation and autotuning happen here
        torch.autograd.grad(forward(), inputs, do)
        progress.step()
    synchronize(device)

    # One step alone for memory: the allocator's counters live on the host, no synchronisation needed.
    reset_peak_memory(device)
    out = forward()
    peak_fwd, before_bwd = peak_memory(device), current_memory(device)
    reset_peak_memory(device)
    grads = torch.autograd.grad(out, inputs, do)
    peak_bwd = peak_memory(device)
    del out, grads

    timer = RegionTimer(device)
    for _ in range(sweep.steps):
        with timer.region("forward+backward"):
            with timer.region("forward"):
                out = forward()
            with timer.region("backward"):
                grads = torch.autograd.grad(out, inputs, do)
        del out, grads
        progress.step()
    stats = timer.stats()
    fwd, bwd, total = stats["forward"], stats["backward"], stats["forward+backward"]
    host = _host_us(lambda: torch.autograd.grad(forward(), inputs, do), device, min(HOST_CALLS, sweep.steps))

    def rate(direction: str, ms: float) -> float:  # TFLOP/s = attention_flops / seconds / 1e12
        flops = attention_flops(batch=batch, heads=heads, n_queries=seq, n_keys=seq, d_head=d,
                                causal=sweep.causal, direction=direction)
        return flops / (ms * 1e-3) / 1e12

    return {
        "fwd ms": MeanStd(fwd.mean, fwd.std),
        "bwd ms": MeanStd(bwd.mean, bwd.std),
        "fwd+bwd ms": MeanStd(total.mean, total.std),
        "fwd TFLOP/s": rate("fwd", fwd.mean),
        "bwd TFLOP/s": rate("bwd", bwd.mean),
        "fwd+bwd TFLOP/s": rate("fwd+bwd", total.mean),
        "peak fwd MiB": _mib(peak_fwd),
        "before bwd MiB": _mib(before_bwd),
        "peak bwd MiB": _mib(peak_bwd),
        "host µs": host,
        "status": verdict,
    }


def check_step(out, inputs: tuple, do, causal: bool, dtype: str, *, user: bool = False) -> str:
    """'ok', or 'wrong (O err 3.1e-01)': the output and gradients of one step against the float64 reference
    (flash check's error and tolerance), on batch element 0 and the query heads that share key/value head
    0, on the inputs' device: exact for those heads (their dQ, dK, dV depend on nothing else) at the cost of
    one head group's score matrix. A reference that does not fit says so and leaves the row unchecked.
    `user`: a user's attention, whose fp32 on a GPU is held to the handout's tolerance (flash_check.tolerance)."""
    import torch

    from lmsys.bench.flash_check import relative_error, tolerance
    from lmsys.core.devices import is_oom
    from lmsys.kernels.attention import reference_attention

    q, k, v = inputs
    grads = torch.autograd.grad(out, inputs, do)
    group = q.shape[-3] // k.shape[-3]
    mine = (out[0, :group], grads[0][0, :group], grads[1][0, :1], grads[2][0, :1])
    try:  # float64 on the inputs' device: one head group's scores (2 GiB at 16,384 keys)
        q0, k0, v0 = (x[0, :n].detach().to(torch.float64).requires_grad_() for x, n in ((q, group), (k, 1), (v, 1)))
        o_ref, _ = reference_attention(q0, k0, v0, causal, device=q.device)
        refs = (o_ref, *torch.autograd.grad(o_ref, (q0, k0, v0), do[0, :group].to(o_ref.dtype)))
    except Exception as exc:  # noqa: BLE001 - only an out-of-memory reference is survivable
        if not is_oom(exc):
            raise
        return "ok (unchecked: the reference ran out of memory)"
    tol = tolerance(dtype, user=user, device=q.device)
    errors = {name: relative_error(got, ref) for name, got, ref in zip(("O", "dQ", "dK", "dV"), mine, refs)}
    del refs, grads
    bad = [f"{name} err {err:.1e}" for name, err in errors.items() if not err <= tol]
    return f"wrong ({', '.join(bad)})" if bad else "ok"


def _host_us(step, device, calls: int) -> float:
    """Median µs the host takes to issue `step` (one forward and backward), each call started on an idle
    device (synchronized before, not after: the time to issue, not to run). On a CPU, the whole step."""
    import statistics
    import time

    times = []
    for _ in range(calls):
        synchronize(device)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    synchronize(device)
    return statistics.median(times) * 1e6


def _mib(n: int | None) -> float | None:
    return None if n is None else n / MiB


def plot_attention(rows: list[dict], path, *, title: str) -> None:
    """fwd+bwd time against sequence length, log-log, to a PNG: one panel per head dim, one colour per
    implementation (the same in every panel, in the order they ran), a line style per batch × heads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    series: dict[tuple, list[tuple[int, float]]] = {}
    for row in rows:
        if row.get("status") == "ok":
            key = (row["impl"], row["d"], row["batch"], row["heads"], row.get("dtype"))
            series.setdefault(key, []).append((row["seq"], row["fwd+bwd ms"].mean))
    if not series:
        raise LmsysError("--plot: no configuration ran (all out of memory or unsupported); nothing to plot")
    impls = list(dict.fromkeys(k[0] for k in series))
    dims = sorted({k[1] for k in series})
    shapes = list(dict.fromkeys((k[2], k[3]) for k in series))
    colours = plt.get_cmap("tab10").colors
    cols = min(len(dims), 2)
    rows_ = -(-len(dims) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.5 * cols, 3.8 * rows_), squeeze=False)
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    # minor ticks labelled at 2 and 5 times a power of ten only: 0.3, 0.4, ... 0.9 overlapped
    sparse = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")
    for ax, d in zip(axes.flat, dims):
        for (impl, dd, batch, heads, dtype), points in series.items():
            if dd != d:
                continue
            points.sort()
            style = ("-", "--", ":", "-.")[shapes.index((batch, heads)) % 4]
            label = impl + (f" b={batch} h={heads}" if len(shapes) > 1 else "") + (f" {dtype}" if dtype else "")
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", markersize=4,
                    color=colours[impls.index(impl) % len(colours)], label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(sparse)
        ax.set_title(f"d = {d}", fontsize="medium")
        ax.set_xlabel("sequence length")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(dims):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("forward + backward (ms)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat[1:len(dims)]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.05 + 0.03 * ((len(labels) - 1) // 4), 1, 1))
    save_figure(fig, path, what="--plot", dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------- the command's

@dataclass
class AttentionRun:
    """What `bench attention` runs, its options checked (`resolve`): one sweep per dtype."""

    sweeps: list[Sweep]
    device: object
    notes: list[str]  # what was chosen for the user (a CPU fallback, the small CPU sweep): said before it runs
    plot: str | None = None


def resolve(*, impl, adapters, batch, heads, kv_heads, d_head, seq_len, dtype, causal, preset, warmup, steps, policy,
            plot, device: str) -> AttentionRun:
    """Every option of `bench attention` checked: the torch-free ones first (a typo answers before torch
    loads), then the device and the sweeps (an implementation that needs Triton, not installed: one line
    naming the extra)."""
    from lmsys.core.devices import resolve_device
    from lmsys.core.files import check_output_path
    from lmsys.core.parsing import check_dtypes, parse_int_list, parse_list

    check_output_path(plot, what="--plot")
    dtypes = check_dtypes(dtype) if dtype is not None else [None]
    for text in policy or ():
        split_policy(text)  # the syntax; the fields and values once the kernels' Policy is imported
    dev = resolve_device(device)
    from lmsys.kernels.registry import ATTENTION
    from lmsys.kernels.requirements import require_triton

    for name in parse_list(impl, str, what="--impl") if impl else ():
        if name in ATTENTION and ATTENTION[name].needs_triton:
            require_triton(name)
    sizes = dict(impls=parse_list(impl, str, what="--impl") if impl else None,
                 batch=parse_int_list(batch, what="--batch-size") or None,
                 heads=parse_int_list(heads, what="--heads") or None,
                 d_head=parse_int_list(d_head, what="--d-head") or None,
                 seq_len=parse_int_list(seq_len, what="--context-length") or None)
    resolved = [resolve_sweep(device=dev, preset=preset, dtype=one, causal=causal, warmup=warmup, steps=steps,
                              kv_heads=kv_heads, policies=policy, adapters=adapters, **sizes)
                for one in dtypes]
    _, notes = resolved[0]  # the notes say what was chosen, the same for every dtype
    return AttentionRun(sweeps=[sweep for sweep, _ in resolved], device=dev, notes=notes, plot=plot)


def attention_report(run: AttentionRun):
    """`bench attention`: every sweep (under the progress display), one Report; the plot when asked."""
    from lmsys.core.devices import environment
    from lmsys.core.flops import ATTENTION_RATE_NOTE
    from lmsys.core.results import Report

    sweeps = run.sweeps
    rows = list(progress.rows(run_sweeps(sweeps, device=run.device), total=sum(s.size for s in sweeps),
                              description="bench attention"))
    meta = environment(run.device)
    meta["run"] = describe_sweeps(sweeps)
    notes = list(run.notes)
    notes.append("ms: mean ± std over the timed steps (CUDA events on a GPU). " + ATTENTION_RATE_NOTE)
    notes.append("Memory (GPU only): peak allocated during one forward, allocated just before its backward "
                 "(inputs, saved tensors, output), peak during the backward.")
    notes.append("status: each row's first step is checked: O, dQ, dK, dV of batch element 0 (the query heads "
                 "of key/value head 0) against float64, err = max |x - ref| / max(max |ref|, 1), tolerance "
                 "fp32 1e-4 (your attention's on a GPU: 1e-2, the handout's), bf16/fp16 2e-2; `wrong (...)` names the tensors beyond it, and the command exits 1.")
    notes.append("host µs: median host time to issue one forward+backward on an idle device, after the timed "
                 "steps; near fwd+bwd ms × 1000 the row is host-bound (on a CPU: the whole step).")
    if any(s.dtype == "fp32" and any(attention_spec(i).triton_kernel for i in s.impls) for s in sweeps):
        from lmsys.kernels.dots import fp32_dots, matmul_precision

        notes.append(f"flash-triton's fp32 dots: {fp32_dots(run.device)} (torch's float32 matmul precision "
                     f"{matmul_precision()!r}: bf16x6 at 'highest', bf16x3 at 'high'; lmsys.kernels.dots).")
    report = Report("bench attention", rows, meta, notes)
    if run.plot is not None:
        title = f"attention fwd+bwd, {describe_sweeps(sweeps).split(', warmup')[0]}"
        plot_attention(rows, run.plot, title=title)
        notes.append(f"Plot written to {run.plot}.")
    return report
