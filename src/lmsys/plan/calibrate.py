"""`plan calibrate`: measure this machine's rates into a profile that plan train and plan validate predict with.

A list of measurements (`MEASUREMENTS`, in order), each on lmsys.core.timing's timer, each adding its
profile fields and rows: per dtype each model's matmuls as the model runs them, forward and backward apart
(on a GPU a CUDA graph of repeats, `time_graph`: the device's time alone), materialized attention's s×s
products, attention forward + backward at the model's heads and sequence (naive s×s scores for lmsys's
naive attention, SDPA otherwise); a large copy (HBM or RAM bandwidth), an elementwise multiply at the
model's activation size, the AdamW step `bench e2e` runs, on a GPU the rate a block's own elementwise
kernels reach (the profiler's kernel time of one block less its matmuls, `kernel_ms`), the host's cost
per dispatched op (twins of the model with 2 and 6 blocks, their ops counted with a dispatch mode), and
the all-reduce busbw per size and world size through lmsys.bench.comm (the job `comm allreduce` runs,
started by the one launcher): with nccl on 2, 4, 8 ... of this machine's GPUs (2 or more), with gloo on 2
processes on a CPU (a few sizes, 1 KiB to 4 MiB); the smallest size's time is the latency; and with
`--sustain` the rate the GEMMs keep back to back at the power limit (`measure_sustained`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmsys.core.errors import LmsysError
from lmsys.core.flops import attention_flops
from lmsys.core.parsing import MiB
from lmsys.core import progress
from lmsys.core.timing import kernel_ms, time_fn, time_graph  # kernel_ms: importable from here too
from lmsys.plan.memory import PRECISIONS
from lmsys.plan.shape import ModelShape, block_gemms, head_gemm
from lmsys.plan.time import optimizer_bytes

# all-reduce sizes: on GPUs (nccl), and on a CPU (gloo, 2 processes: a few, so it stays quick); the first is
# small enough that its time is the latency
BUSBW_SIZES = (2**10, 2**20, 2**23, 2**26, 2**28)
CPU_BUSBW_SIZES = (2**10, 2**14, 2**18, 2**22)


@dataclass
class Calibration:
    """What every measurement reads (the models, the device, the dtypes, the batch and the timer's warm-up and
    steps) and writes: the profile, and one row per measurement."""

    models: list
    device: object
    dtypes: list
    batch_size: int
    warmup: int
    steps: int
    collectives: bool
    sustain: float = 0.0  # seconds of the largest GEMM before measure_sustained's windows (0: not measured)
    profile: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    @property
    def timing(self) -> dict:
        return dict(device=self.device, warmup=self.warmup, steps=self.steps)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def calibrate(models, *, device, dtypes: list[str], batch_size: int, warmup: int, steps: int,
              collectives: bool | None = None, sustain: float = 0.0) -> tuple[dict, list[dict]]:
    """(profile, rows): the rates the time model uses, and one row per measurement, from `MEASUREMENTS` in
    order. `models`: one ModelShape or several; each one's matmul and attention shapes are timed, and the
    first one's width sizes the host twin and the elementwise multiply. `collectives`: also the all-reduce
    busbw and latency (None: on a CPU, and on a GPU where 2 or more are visible); the profile has "busbw"
    and "latency_us" when measured. `sustain` > 0: also the GEMMs' sustained rate after that many seconds of
    the largest (`measure_sustained`)."""
    import torch

    from lmsys.core.devices import device_name

    models = [models] if isinstance(models, ModelShape) else list(models)
    if collectives is None:
        collectives = torch.device(device).type != "cuda" or torch.cuda.device_count() >= 2
    c = Calibration(models, device, list(dtypes), batch_size, warmup, steps, collectives, sustain)
    c.profile = {"device": device_name(device), "matmul_tflops": {}, "attention_tflops": {}, "gemm_tflops": {}}
    memory_GB = device_memory_GB(device)
    if memory_GB is not None:  # plan train's capacity for a device the GPU table does not know (a CPU)
        c.profile["memory_GB"] = memory_GB
    per_model = [_matmul_shapes(m, tokens=batch_size * m.seq) for m in models]
    shapes = sum(len(s) for s in per_model)
    naive = sum(m.attention != "flash" for m in models)
    sustained = len(sustain_dtypes(dtypes)) * len(set().union(*per_model)) if sustain > 0 else 0
    progress.plan_rows(len(dtypes) * (shapes + naive + len(models) + 1 + c.cuda) + 3 + sustained)
    for measure in MEASUREMENTS:
        measure(c)
    return c.profile, c.rows


def measure_compute(c: Calibration) -> None:
    """Per dtype: each model's matmuls (`gemm_tflops`, `matmul_tflops`: all their FLOPs over all their
    time), materialized attention's s×s products (`scores_tflops`), attention fwd+bwd (`attention_tflops`)."""
    from lmsys.core.devices import torch_dtype

    for dtype in c.dtypes:
        dt = torch_dtype(dtype)
        _matmul_rates(c, dtype, dt)
        _scores_rates(c, dtype, dt)
        _attention_rate(c, dtype, dt)


def _matmul_rates(c: Calibration, dtype: str, dt) -> None:
    """Each model's matmuls as it runs them, forward and backward apart (core.timing.time_graph)."""
    total_flops = total_ms = 0.0
    points: dict = {}
    for model in c.models:
        tag = f" ({model.name})" if len(c.models) > 1 else ""
        for (M, K, N), names in _matmul_shapes(model, tokens=c.batch_size * model.seq).items():
            progress.start_row(f"matmul {names}{tag} {dtype}")
            fwd_ms, bwd_ms = _linear_ms(M, K, N, dt=dt, **c.timing)
            flops = 2.0 * M * K * N
            points[M, K, N] = [M, K, N, flops / fwd_ms / 1e9, 2 * flops / bwd_ms / 1e9]
            total_flops, total_ms = total_flops + 3 * flops, total_ms + fwd_ms + bwd_ms
            c.rows += [{"what": f"matmul {names}{tag}", "dtype": dtype, "shape": f"{M}×{K}·{K}×{N}",
                        "ms": fwd_ms, "TFLOP/s": points[M, K, N][3]},
                       {"what": f"matmul {names}{tag} backward", "dtype": dtype,
                        "shape": f"{M}×{N}·{N}×{K}, {N}×{M}·{M}×{K}", "ms": bwd_ms,
                        "TFLOP/s": points[M, K, N][4]}]
    c.profile["gemm_tflops"][dtype] = list(points.values())
    c.profile["matmul_tflops"][dtype] = total_flops / total_ms / 1e9


def _scores_rates(c: Calibration, dtype: str, dt) -> None:
    """Materialized attention's s×s products at each naive model's heads, sequence and head size."""
    scores: dict = {}
    for model in (m for m in c.models if m.attention != "flash"):
        progress.start_row(f"s×s products ({model.name}) {dtype}")
        heads = c.batch_size * model.heads
        if (heads, model.seq, model.d_head) in scores:
            continue
        fwd_ms, bwd_ms = _scores_ms(heads, model.seq, model.d_head, dt=dt, **c.timing)
        flops = 4.0 * heads * model.seq ** 2 * model.d_head
        scores[heads, model.seq, model.d_head] = [heads, model.seq, model.d_head, flops / fwd_ms / 1e9,
                                                  2 * flops / bwd_ms / 1e9]
        shape = f"b{c.batch_size} h{model.heads} s{model.seq} d{model.d_head}"
        c.rows += [{"what": f"attention s×s products (QKᵀ, ·V) ({model.name})", "dtype": dtype, "shape": shape,
                    "ms": fwd_ms, "TFLOP/s": flops / fwd_ms / 1e9},
                   {"what": f"attention s×s products backward ({model.name})", "dtype": dtype, "shape": shape,
                    "ms": bwd_ms, "TFLOP/s": 2 * flops / bwd_ms / 1e9}]
    if scores:
        c.profile.setdefault("scores_tflops", {})[dtype] = list(scores.values())


def _attention_rate(c: Calibration, dtype: str, dt) -> None:
    """Attention forward + backward at each model's heads and sequence (time_fn)."""
    attn_flops = attn_ms = 0.0
    for model in c.models:
        progress.start_row(f"attention ({model.name}) {dtype}")
        ms, flops, label = _attention(model, dt=dt, batch=c.batch_size, **c.timing)
        attn_flops, attn_ms = attn_flops + flops, attn_ms + ms
        c.rows.append({"what": f"attention {label} fwd+bwd", "dtype": dtype,
                       "shape": f"b{c.batch_size} h{model.heads} s{model.seq} d{model.d_head}", "ms": ms,
                       "TFLOP/s": flops / (ms * 1e-3) / 1e12})
    c.profile["attention_tflops"][dtype] = attn_flops / (attn_ms * 1e-3) / 1e12


def measure_copy(c: Calibration) -> None:
    """`hbm_GBps`: a large copy (256 MiB on a GPU, 32 MiB of RAM on a CPU), read + write (time_fn)."""
    import torch

    progress.start_row("memory copy")
    numel = (256 if c.cuda else 32) * MiB // 4
    x = torch.empty(numel, device=c.device, dtype=torch.float32).normal_()
    y = torch.empty_like(x)
    ms = time_fn(lambda: y.copy_(x), **c.timing).median
    c.profile["hbm_GBps"] = 2 * x.numel() * 4 / (ms * 1e-3) / 1e9  # read + write
    c.rows.append({"what": "memory copy", "dtype": "fp32", "shape": f"{x.numel() * 4 // MiB} MiB", "ms": ms,
                   "GB/s": c.profile["hbm_GBps"]})


def measure_multiply(c: Calibration) -> None:
    """`elementwise_GBps`: an fp32 multiply at the first model's s·b·d_ff, read two, write one (time_fn)."""
    import torch

    progress.start_row("elementwise multiply")
    m = c.models[0]
    tokens = c.batch_size * m.seq
    n = tokens * m.d_ff
    a, b, out = (torch.randn(n, device=c.device) for _ in range(3))
    ms = time_fn(lambda: torch.mul(a, b, out=out), **c.timing).median
    c.profile["elementwise_GBps"] = 3 * n * 4 / (ms * 1e-3) / 1e9  # read two, write one
    c.rows.append({"what": "elementwise multiply", "dtype": "fp32", "shape": f"{tokens}×{m.d_ff}", "ms": ms,
                   "GB/s": c.profile["elementwise_GBps"]})


def measure_optimizer(c: Calibration) -> None:
    """`optimizer_GBps`: the AdamW step bench e2e runs, over `optimizer_bytes` a parameter (time_fn)."""
    progress.start_row("AdamW step")
    ms, numel = _optimizer(**c.timing)
    c.profile["optimizer_GBps"] = numel * optimizer_bytes(PRECISIONS["fp32"]) / (ms * 1e-3) / 1e9
    c.rows.append({"what": "AdamW step (28 B/parameter)", "dtype": "fp32", "shape": f"{numel // 2**20} M parameters",
                   "ms": ms, "GB/s": c.profile["optimizer_GBps"]})


def measure_block_elementwise(c: Calibration) -> None:
    """On a GPU, per dtype, `block_elementwise_GBps`: the rate a block's own elementwise kernels reach
    (`_block_elementwise`: core.timing.kernel_ms). A CPU: the multiply's rate stands (nothing measured)."""
    if not c.cuda:
        return
    for dtype in c.dtypes:
        progress.start_row(f"block elementwise {dtype}")
        gbps, row = _block_elementwise(c.models[0], c.profile, dtype=dtype, batch_size=c.batch_size, **c.timing)
        c.profile.setdefault("block_elementwise_GBps", {})[dtype] = gbps
        c.rows.append(row)


def measure_host_rates(c: Calibration) -> None:
    """`host_overlap` (a GPU), `threads` (a CPU: what every rate above was measured with; plan validate scales
    by them), and per dtype `launch_us`, `launch_us_recompute` and `ops` (`measure_host`: the host twins)."""
    import torch

    profile = c.profile
    profile["host_overlap"] = c.cuda
    if c.device.type == "cpu":
        profile["threads"] = torch.get_num_threads()
    profile["launch_us"], profile["launch_us_recompute"], profile["ops"] = {}, {}, {}
    for dtype in c.dtypes:
        progress.start_row(f"host {dtype}")
        us, us_again, ops, times = measure_host(c.models[0], dtype=dtype, **c.timing)
        profile["launch_us"][dtype], profile["launch_us_recompute"][dtype], profile["ops"][dtype] = us, us_again, ops
        c.rows.append({"what": "host, per dispatched op", "dtype": dtype,
                       "shape": f"{HOST_BLOCKS[1] - HOST_BLOCKS[0]} blocks, {HOST_SEQ if c.cuda else 8} tokens",
                       "ms": times["none"], "µs/op": us})
        c.rows.append({"what": "host, per recomputed op", "dtype": dtype,
                       "shape": f"{HOST_BLOCKS[1] - HOST_BLOCKS[0]} checkpointed blocks", "ms": times["block"],
                       "µs/op": us_again})


def measure_collectives(c: Calibration) -> None:
    """With `collectives`: `busbw` and `latency_us`, the all-reduce through lmsys.bench.comm's job (`_busbw`)."""
    if not c.collectives:
        return
    busbw, latency_us, comm_rows = _busbw(c.device, c.dtypes[-1], warmup=c.warmup, steps=c.steps)
    if busbw:
        c.profile["busbw"], c.profile["latency_us"] = busbw, latency_us
    c.rows += comm_rows


def _matmul_shapes(m: ModelShape, *, tokens: int) -> dict:
    """{(M, K, N): the names of `m`'s matmuls of that shape} (a block's and the LM head's)."""
    out: dict = {}
    for name, M, K, N in [*block_gemms(m, tokens=tokens), head_gemm(m, tokens=tokens)]:
        out[M, K, N] = f"{out[M, K, N]} / {name}" if (M, K, N) in out else name
    return out


def _linear_ms(M: int, K: int, N: int, *, device, dt, warmup: int, steps: int) -> tuple[float, float]:
    """(forward ms, backward ms) of a linear layer as the model runs it (F.linear, weight [N, K]) on M rows:
    x·Wᵀ; then autograd's two products, dY·W and dYᵀ·x."""
    import torch
    import torch.nn.functional as F

    x, w, g = (torch.randn(*shape, device=device, dtype=dt) for shape in ((M, K), (N, K), (M, N)))

    def backward():
        g @ w
        g.t() @ x

    kw = dict(device=device, warmup=warmup, steps=steps)
    return time_graph(lambda: F.linear(x, w), **kw).median, time_graph(backward, **kw).median


def _scores_ms(heads: int, s: int, d: int, *, device, dt, warmup: int, steps: int) -> tuple[float, float]:
    """(forward ms, backward ms) of materialized attention's products over `heads` (batch × heads) s×s
    score matrices: QKᵀ and P·V; then dO·Vᵀ, Pᵀ·dO, dS·K and dSᵀ·Q."""
    import torch

    q, k, v, do = (torch.randn(heads, s, d, device=device, dtype=dt) for _ in range(4))
    p = torch.randn(heads, s, s, device=device, dtype=dt)

    def forward():
        q @ k.transpose(-1, -2)
        p @ v

    def backward():
        do @ v.transpose(-1, -2)
        p.transpose(-1, -2) @ do
        p @ k
        p.transpose(-1, -2) @ q

    kw = dict(device=device, warmup=warmup, steps=steps)
    return time_graph(forward, **kw).median, time_graph(backward, **kw).median


def device_memory_GB(device) -> float | None:
    """The device's memory in GB (1e9 bytes): a GPU's total, or the host's physical RAM for a CPU (None
    where the platform does not say)."""
    import os

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (AttributeError, ValueError, OSError):
        return None


def _optimizer(device, *, warmup: int, steps: int) -> tuple[float, int]:
    """(ms, parameters) of the AdamW step bench e2e runs here (fused on a GPU) over fp32 parameters in 4
    tensors, gradients set: 256 M on a GPU (4 GiB with gradients and moments; at 16 M the fused step ran
    at 2.1 TB/s on an H200, inside xl's and 2.7b's steps at 2.7), 4 M on a CPU."""
    import torch

    from lmsys.train.optim import make_optimizer

    numel = (256 if device.type == "cuda" else 4) * 2**20
    params = [torch.nn.Parameter(torch.randn(numel // 4, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_optimizer(params, lr=1e-3, kind=plain_step_options(device, "fp32")["optimizer"])
    return time_fn(opt.step, warmup=warmup, steps=steps, device=device).median, numel


def host_ops(m: ModelShape, *, device, dtype: str) -> tuple[dict, int]:
    """(OpCounts fields, ops of the 2-block step): the ops eager PyTorch dispatches in a training step of
    lmsys's model (bench e2e's plain path, `m`'s attention) at a tiny width, counted with a dispatch mode
    for 1 and 2 blocks, with and without full recomputation; the difference is one block's. Selective
    recomputation's extra (`recompute_core`): the attention core alone, checkpointed or not (`_core_ops`)."""
    counts = {}
    for layers in (1, 2):
        for checkpoint in ("none", "block"):
            step, inputs, targets = _tiny_step(m, layers=layers, checkpoint=checkpoint, device=device, dtype=dtype)
            for _ in range(2):  # the second step: the optimizer's state exists
                step.zero_grad()
                with _Count() as fwd:
                    loss = step.forward(inputs, targets)
                with _Count() as bwd:
                    step.backward(loss)
                with _Count() as opt:
                    step.optimizer_step()
            tensors = sum(1 for _ in step.model.parameters())
            counts[layers, checkpoint] = (fwd.n, bwd.n, opt.n, tensors)
    (f1, b1, o1, t1), (f2, b2, o2, t2) = counts[1, "none"], counts[2, "none"]
    b2_full = counts[2, "block"][1]
    per_tensor = (o2 - o1) / (t2 - t1)
    ops = {"fwd_layer": f2 - f1, "bwd_layer": b2 - b1, "recompute_layer": (b2_full - b2) / 2,
           "fwd_other": 2 * f1 - f2, "bwd_other": 2 * b1 - b2, "opt_base": o1 - per_tensor * t1,
           "opt_per_tensor": per_tensor, "recompute_core": _core_ops(m, device=device, dtype=dtype)}
    return ops, f2 + b2 + o2


def _core_ops(m: ModelShape, *, device, dtype: str) -> int:
    """What selective recomputation dispatches again per block: the ops the backward of a checkpointed
    attention core (the model's attention call: `m`'s kind, its kv heads, the step's autocast) runs beyond
    the plain core's backward, at a tiny shape (the core's forward again and the checkpoint's own ops, as
    `recompute_layer` counts them for the whole block)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from lmsys.core.devices import torch_dtype
    from lmsys.kernels.attention import attention

    impl = "naive" if m.attention == "naive" else "sdpa"
    kv = 1 if m.kv_heads != m.heads else 2

    def core(q, k, v):
        return attention(q, k, v, is_causal=True, impl=impl)

    counts = []
    for recompute in (False, True):
        q = torch.randn(1, 2, 8, 8, device=device, requires_grad=True)
        k, v = (torch.randn(1, kv, 8, 8, device=device, requires_grad=True) for _ in range(2))
        with torch.autocast(device.type, dtype=torch_dtype(dtype), enabled=dtype != "fp32"):
            out = checkpoint(core, q, k, v, use_reentrant=False) if recompute else core(q, k, v)
        with _Count() as bwd:
            out.float().sum().backward()
        counts.append(bwd.n)
    return counts[1] - counts[0]


HOST_SEQ = 16  # the host twin's sequence length: the device's work stays negligible beside the host's


def twin_config(m: ModelShape, *, layers: int, width: str = "tiny", seq: int = HOST_SEQ):
    """The ModelConfig of `_tiny_step`'s model: lmsys's block with `m`'s attention kind and kv heads,
    "tiny" (16 wide, 8 tokens) or "model" (`m`'s width and heads, `seq` tokens), a 32-token vocabulary."""
    from lmsys.model.config import ModelConfig

    attn_impl = "naive" if m.attention == "naive" else "sdpa"
    if width == "model":
        return ModelConfig(d_model=m.d_model, d_ff=m.d_ff, num_layers=layers, num_heads=m.heads, vocab_size=32,
                           context_length=seq, attn_impl=attn_impl,
                           num_kv_heads=m.kv_heads if m.kv_heads != m.heads else None)
    return ModelConfig(d_model=16, d_ff=32, num_layers=layers, num_heads=2, vocab_size=32, context_length=8,
                       attn_impl=attn_impl, num_kv_heads=1 if m.kv_heads != m.heads else None)


def _tiny_step(m: ModelShape, *, layers: int, checkpoint: str, device, dtype: str, width: str = "tiny",
               seq: int = HOST_SEQ, batch: int = 1):
    """bench e2e's plain step of `twin_config`'s model: "tiny" at batch 1 (counting ops) or "model" at
    `batch` sequences of `seq` tokens (by default the host's cost of the model's own ops, tensors of its
    sizes)."""
    from lmsys.bench import e2e
    from lmsys.train.build import build_train_step
    from lmsys.train.step import random_batch

    options = plain_step_options(device, dtype)
    options.pop("attn_impl")
    cfg = twin_config(m, layers=layers, width=width, seq=seq)
    (_, workload), = e2e.resolve_workloads([("tiny", cfg)], checkpoints=[checkpoint],
                                          batch_size=batch if width == "model" else 1, dtype=dtype,
                                          cuda_graphs=False, **options)
    step = build_train_step(workload, device)
    inputs, targets = random_batch(workload, device)
    return step, inputs, targets


def plain_step_options(device, dtype: str) -> dict:
    """bench e2e's plain path (what validate runs): naive attention, eager, AdamW (fused on a GPU)."""
    from lmsys.bench import e2e

    return e2e.step_options(device, dtype, fast=False, attn=None, compile_scope=None, optimizer="auto",
                            master_weights=False, fused_ce="off", tf32=False)


class _Count:
    """Counts the ops dispatched inside the block (a TorchDispatchMode)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.n += 1
                return func(*args, **(kwargs or {}))

        self.n = 0
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


BLOCKS = (1, 3)  # the block counts whose difference is one block's device time (block elementwise)


def _block_elementwise(m: ModelShape, profile: dict, *, device, dtype: str, batch_size: int, warmup: int,
                       steps: int) -> tuple[float, dict]:
    """(GB/s, row): the rate at which a block's own elementwise kernels (norms, RoPE, the scores' chain,
    activation, residual adds, autocast's casts) move the bytes the time model counts for them. The device
    time of one block's forward and backward (kernels summed by the profiler, BLOCKS' difference, lmsys's
    block at `m`'s width, heads and attention kind, batch_size × `m`'s sequence) less its matmuls at the
    rates measured above, over that block's bytes. Kernels of many kinds (strided, converting, fp32
    softmax under autocast) reach well below a contiguous multiply: on an H200 inside 2.7b's bf16 step
    they took 80 ms where the multiply's rate predicted 37. Capped at that multiply's rate (no
    elementwise kernel beats it; a block whose matmuls ran faster than timed alone would otherwise leave
    too little); the multiply's rate, said in the row, where the profiler recorded no kernels (a
    calibration under nsys or ncu)."""
    from lmsys.plan import memory as mem
    from lmsys.plan.profile import rates as profile_rates
    from lmsys.plan.shape import from_model_config
    from lmsys.plan.time import block_cost
    from lmsys.train.step import run_step

    totals = []  # device ms of a step of BLOCKS[0], then BLOCKS[1] blocks
    for layers in BLOCKS:
        step, inputs, targets = _tiny_step(m, layers=layers, checkpoint="none", device=device, dtype=dtype,
                                           width="model", seq=m.seq, batch=batch_size)
        totals.append(kernel_ms(lambda: run_step(step, inputs, targets, mode="fwd-bwd"), device=device,
                                warmup=warmup, steps=max(steps, 3)))
    block_ms = (totals[1] - totals[0]) / (BLOCKS[1] - BLOCKS[0])
    twin = from_model_config(twin_config(m, layers=1, width="model", seq=m.seq), name=f"{m.name} block")
    bc = block_cost(twin, b=batch_size, t=1, sp=False, prec=mem.precision(dtype, master_weights=False),
                    rates=profile_rates(profile, dtype))
    moved = bc.bytes_fwd + bc.bytes_bwd
    elementwise_ms = block_ms - bc.matmul_fwd - bc.matmul_bwd
    cap = float(profile["elementwise_GBps"])
    what = "elementwise, a block's own kernels"
    if block_ms <= 0:
        gbps, what = cap, what + " (no kernel time recorded: the multiply's rate)"
    else:
        gbps = cap if elementwise_ms <= 0 else min(cap, moved / (elementwise_ms * 1e-3) / 1e9)
    return gbps, {"what": what, "dtype": dtype, "shape": f"{BLOCKS[1]} - {BLOCKS[0]} blocks, b{batch_size} s{m.seq}",
                  "ms": elementwise_ms, "GB/s": gbps}


HOST_BLOCKS = (2, 6)  # the tiny steps' block counts whose difference the host rates are measured on


def measure_host(m: ModelShape, *, device, dtype: str, warmup: int, steps: int, blocks: tuple[int, int] = HOST_BLOCKS,
                 recompute: bool = True) -> tuple[float, float | None, dict, dict]:
    """(µs per dispatched op, µs per op a recomputed block dispatches again, OpCounts fields, {"none" |
    "block": ms the extra blocks took}): forward and backward of twins of the model with `blocks` blocks,
    with and without full recomputation, where the device's work is negligible (on a GPU: the model's width,
    HOST_SEQ tokens; on a CPU, which computes too: the tiny width). The difference between the two block
    counts is that many blocks' host time alone, free of what a step runs once (the embedding, the loss,
    the optimizer's Python), which a whole tiny step would spread over too few ops; divided by the ops
    those blocks dispatch (and, checkpointed, by the ops recomputation adds). `blocks`: other block counts
    (a twin at the model's depth); recompute=False: the plain twins only (the
    recomputed op's cost None). Each twin's step is timed by lmsys.train.loop's timed_loop, as bench e2e's
    is: its "step" region (forward and backward; the gradients are cleared before it, outside)."""
    from lmsys.train.loop import timed_loop

    few, many = blocks
    if not 1 <= few < many:
        raise ValueError(f"the host twins' block counts must grow from 1 or more, got {blocks}")

    ops, _ = host_ops(m, device=device, dtype=dtype)
    width = "model" if device.type == "cuda" else "tiny"
    ms = {}
    policies = ("none", "block") if recompute else ("none",)
    for checkpoint in policies:
        for layers in blocks:
            step, inputs, targets = _tiny_step(m, layers=layers, checkpoint=checkpoint, device=device, dtype=dtype,
                                               width=width)
            # no optimizer: its device time would grow with the blocks too
            w, n = max(warmup, 3), max(steps, 20)
            timer = timed_loop(step, [(inputs, targets)] * (w + n), warmup=w, device=device, mode="fwd-bwd")
            ms[checkpoint, layers] = timer.stats()["step"].median
    extra = {c: ms[c, many] - ms[c, few] for c in policies}
    us = max(extra["none"] * 1e3 / ((many - few) * (ops["fwd_layer"] + ops["bwd_layer"])), 0.1)
    us_again = max((extra["block"] - extra["none"]) * 1e3 / ((many - few) * ops["recompute_layer"]), 0.1) \
        if recompute else None
    return us, us_again, ops, extra


def _attention(m: ModelShape, *, device, dt, batch: int, warmup: int, steps: int):
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(batch, m.heads, m.seq, m.d_head, device=device, dtype=dt, requires_grad=True)
               for _ in range(3))
    if m.attention == "flash":
        def run():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        causal, label = True, "sdpa causal"
    else:
        mask = torch.ones(m.seq, m.seq, dtype=torch.bool, device=device).tril()

        def run():
            scores = (q @ k.transpose(-1, -2)) * m.d_head ** -0.5
            (torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v).sum().backward()
        causal, label = False, "s×s scores"
    ms = time_fn(run, warmup=warmup, steps=steps, device=device).median
    flops = attention_flops(batch=batch, heads=m.heads, n_queries=m.seq, n_keys=m.seq, d_head=m.d_head,
                            causal=causal, direction="fwd+bwd")
    return ms, flops, label


def _busbw(device, dtype: str, *, warmup: int, steps: int) -> tuple[dict, float | None, list[dict]]:
    """({world size: {bytes: busbw GB/s}}, latency µs, rows) of all-reduce through lmsys.bench.comm's job:
    nccl on 2, 4, 8 ... of this machine's GPUs; gloo on 2 processes on a CPU (fp32: gloo reduces no bf16
    on every torch). The latency: the median time of the smallest size on the fewest ranks."""
    import torch

    from lmsys.core.parsing import format_bytes
    from lmsys.distributed import launch

    if device.type == "cuda":
        backend, sizes, worlds = "nccl", BUSBW_SIZES, []
        n = 2
        while n <= torch.cuda.device_count():
            worlds.append(n)
            n *= 2
        where = "GPUs"
    else:
        backend, sizes, worlds, dtype, where = "gloo", CPU_BUSBW_SIZES, [2], "fp32", "processes (gloo)"
    out: dict = {}
    rows: list[dict] = []
    latency_us = None
    for n in worlds:
        result = launch.run("lmsys.bench.comm:collective_job",
                            dict(collective="all-reduce", sizes=list(sizes), labels=[str(s) for s in sizes],
                                 dtype=dtype, warmup=max(warmup, 1), iters=max(steps, 3), baseline=False),
                            world_size=n, backend=backend)
        if result is None:  # a torchrun worker other than rank 0
            return out, latency_us, rows
        measured = [(size, row) for size, row in zip(sizes, result["rows"]) if row.get("busbw GB/s")]
        out[n] = {size: row["busbw GB/s"] for size, row in measured}
        if latency_us is None and measured:
            latency_us = measured[0][1]["median ms"] * 1e3
        rows += [{"what": f"all-reduce on {n} {where}", "dtype": dtype, "shape": format_bytes(size),
                  "ms": row["median ms"], "GB/s": row["busbw GB/s"]} for size, row in measured]
    return out, latency_us, rows


def gpu_state(device) -> dict:
    """The SM clock, power draw and limit and temperature nvidia-smi reports now for `device` (picked by its
    PCI address, whatever CUDA_VISIBLE_DEVICES numbers it); {} for a CPU or without nvidia-smi."""
    import shutil
    import subprocess

    import torch

    if torch.device(device).type != "cuda" or not shutil.which("nvidia-smi"):
        return {}
    props = torch.cuda.get_device_properties(torch.device(device))
    try:
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,power.limit,temperature.gpu",
                          "--format=csv,noheader,nounits", "-i", bus], capture_output=True, text=True).stdout
    try:
        sm, power, limit, temp = (float(x) for x in out.strip().splitlines()[0].split(","))
    except (ValueError, IndexError):
        return {}
    return {"sm_MHz": sm, "power_W": power, "power_limit_W": limit, "temp_C": temp}


def sustain_dtypes(dtypes: list[str]) -> list[str]:
    """The dtypes `measure_sustained` runs: the 16-bit ones calibrated, else the first."""
    return [d for d in dtypes if d in ("bf16", "fp16")] or dtypes[:1]


def measure_sustained(c: Calibration) -> None:
    """With `sustain` seconds: the rate the models' GEMMs keep when a training run issues them back to back
    (`gemm_sustained`): per 16-bit dtype (fp32 where none is calibrated), `sustain` seconds of the largest
    GEMM first (the clock settles at the power limit: on an H200 within a few seconds), then each forward
    GEMM shape for about a second of calls, timed as one region. Rows [M, K, N, burst TFLOP/s (calibrate's), sustained TFLOP/s]; `fraction`:
    all their FLOPs over all their time, over the dense peak the GPU table gives (None: a part it lacks);
    the SM clock, power and temperature after it (nvidia-smi, where there is one)."""
    import time

    import torch

    from lmsys.core.devices import torch_dtype
    from lmsys.core.hardware import find_gpu
    from lmsys.core.timing import RegionTimer, synchronize

    if c.sustain <= 0:
        return
    seconds = c.sustain
    gpu = find_gpu(c.profile.get("device"))
    out = c.profile.setdefault("gemm_sustained", {})
    for dtype in sustain_dtypes(c.dtypes):
        dt = torch_dtype(dtype)
        burst = {(M, K, N): fwd for M, K, N, fwd, _ in c.profile["gemm_tflops"][dtype]}
        shapes = sorted(burst, key=lambda mkn: -mkn[0] * mkn[1] * mkn[2])
        rows, flops_total, s_total = [], 0.0, 0.0
        for i, (M, K, N) in enumerate(shapes):
            progress.start_row(f"sustained matmul {M}×{K}·{K}×{N} {dtype}")
            a = torch.randn(M, K, device=c.device, dtype=dt)
            b = torch.randn(K, N, device=c.device, dtype=dt)
            flops = 2.0 * M * K * N
            calls = max(1, int(1.0 / (flops / (burst[M, K, N] * 1e12))))  # about a second of calls
            if i == 0:  # heat: the largest GEMM for `seconds` (checked every tenth of a second or call)
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    for _ in range(max(1, calls // 10)):
                        torch.mm(a, b)
                    synchronize(c.device)
            timer = RegionTimer(c.device)
            with timer.region("window"):
                for _ in range(calls):
                    torch.mm(a, b)
            ms = timer.samples("window")[0]
            rows.append([M, K, N, burst[M, K, N], flops * calls / ms / 1e9])
            flops_total, s_total = flops_total + flops * calls, s_total + ms / 1e3
            c.rows.append({"what": "sustained matmul", "dtype": dtype, "shape": f"{M}×{K}·{K}×{N}",
                           "ms": ms / calls, "TFLOP/s": rows[-1][4]})
            del a, b
        peak = gpu.peak(dtype) if gpu else None
        rate = flops_total / s_total / 1e12
        out[dtype] = {"rows": rows, "heat_s": seconds, "TFLOPs": rate,
                      "fraction": rate / peak if peak else None, **gpu_state(c.device)}


# plan calibrate, in order: each measurement reads the Calibration and adds its profile fields and rows
MEASUREMENTS = (measure_compute, measure_copy, measure_multiply, measure_optimizer, measure_block_elementwise,
                measure_host_rates, measure_collectives, measure_sustained)


def sustained_notes(profile: dict) -> list[str]:
    """One line per dtype `measure_sustained` ran: the sustained rate beside the bursts, in the GPU table's
    form (the fraction of the dense peak)."""
    notes = []
    for dtype, sus in (profile.get("gemm_sustained") or {}).items():
        bursts = [r[3] for r in sus["rows"]]
        state = (f"; after it SM {sus['sm_MHz']:g} MHz, {sus['power_W']:g} W of {sus['power_limit_W']:g} W, "
                 f"{sus['temp_C']:g} °C" if "sm_MHz" in sus else "")
        frac = f" = {sus['fraction']:.3f} of the dense peak" if sus.get("fraction") else ""
        notes.append(f"{dtype} GEMMs back to back (after {sus['heat_s']:g} s of the largest): {sus['TFLOPs']:.4g} "
                     f"TFLOP/s over {len(bursts)} shapes{frac}, against bursts of {min(bursts):.4g}–{max(bursts):.4g}"
                     f"{state}.")
    return notes


def resolve(*, size: str, dtype: str | None, batch_size: int, warmup: int, steps: int, profile, device: str,
            sustain: float = 0.0) -> dict:
    """`plan calibrate`'s options checked (the torch-free ones first), as `calibrate_report`'s arguments."""
    from lmsys.core.devices import check_dtype_for_device, resolve_device
    from lmsys.core.files import check_output_path
    from lmsys.core.parsing import check_counts, check_dtypes, parse_list
    from lmsys.plan.shape import load_shape

    check_output_path(profile, what="--profile")
    check_counts(batch_size=(batch_size, 1), warmup=(warmup, 0), steps=(steps, 1))
    if not sustain >= 0:
        raise LmsysError(f"--sustain must be seconds >= 0 (0: not measured), got {sustain}")
    dtypes = check_dtypes(dtype) if dtype else None
    shapes = [load_shape(name) for name in dict.fromkeys(parse_list(size, str, what="--size"))]
    dev = resolve_device(device)
    dtypes = dtypes or (["fp32", "bf16"] if dev.type == "cuda" else ["fp32"])
    for d in dtypes:
        check_dtype_for_device(d, dev)
    return dict(shapes=shapes, device=dev, dtypes=dtypes, batch_size=batch_size, warmup=warmup, steps=steps,
                profile=profile, sustain=sustain)


def matmul_curve(gemms, peak_tflops: float) -> dict | None:
    """The hardware table's matmul curve fit to calibrated GEMMs: a GEMM of F FLOPs takes F / (peak · fraction)
    + launch. `gemms`: a profile's `gemm_tflops[dtype]` rows [M, K, N, forward TFLOP/s, backward TFLOP/s] (the
    backward is two GEMMs of F each). Least squares on the times (each forward and each backward one
    equation, as lmsys.core.hardware.MATMUL_FIT was fit): {fraction, launch_us, mean_error, max_error} (errors
    as fractions of each measured time); None with fewer than two rows, or rows that cannot tell the two
    terms apart (every GEMM of the same FLOPs)."""
    rows = []  # (FLOPs at peak in s, GEMMs, measured s)
    for M, K, N, fwd, bwd in gemms:
        flops = 2.0 * M * K * N
        rows += [(flops / (peak_tflops * 1e12), 1, flops / (fwd * 1e12)),
                 (2 * flops / (peak_tflops * 1e12), 2, 2 * flops / (bwd * 1e12))]
    if len(rows) < 4:
        return None
    sxx = sum(x * x for x, _, _ in rows)
    sxn = sum(x * n for x, n, _ in rows)
    snn = sum(n * n for _, n, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    snt = sum(n * t for _, n, t in rows)
    det = sxx * snn - sxn * sxn
    if det <= 1e-12 * sxx * snn:
        return None
    a, b = (sxt * snn - sxn * snt) / det, (sxx * snt - sxn * sxt) / det  # t = a·x + b·n
    errors = [abs(a * x + b * n - t) / t for x, n, t in rows]
    return {"fraction": 1.0 / a, "launch_us": b * 1e6, "mean_error": sum(errors) / len(errors),
            "max_error": max(errors)}


def curve_notes(profile: dict) -> list[str]:
    """One line per dtype whose peak the GPU table knows for this device: the matmul curve the GEMMs give, in
    the table's form (what lmsys.core.hardware's `matmul` and `gemm_launch_us` hold)."""
    from lmsys.core.hardware import find_gpu

    gpu, notes = find_gpu(profile.get("device")), []
    for dtype, gemms in (profile.get("gemm_tflops") or {}).items():
        peak = gpu.peak(dtype) if gpu else None
        fit = matmul_curve(gemms, peak) if peak else None
        if fit and fit["launch_us"] < 0:  # every GEMM large: the fixed term is below the fit's noise
            notes.append(f"{dtype} GEMM curve ({gpu.name}): {fit['fraction']:.3f} of the {peak:g} TFLOP/s peak; these "
                         f"GEMMs are too alike in size to give the per-GEMM time (the fit's {fit['launch_us']:.1f} µs "
                         "is below zero): calibrate smaller models beside them for it.")
        elif fit:
            notes.append(f"{dtype} GEMM curve ({gpu.name}, the GPU table's form): {fit['fraction']:.3f} of the "
                         f"{peak:g} TFLOP/s peak + {fit['launch_us']:.2f} µs a GEMM (least squares over "
                         f"{2 * len(gemms)} GEMM times: mean |error| {100 * fit['mean_error']:.1f} %, max "
                         f"{100 * fit['max_error']:.1f} %).")
    return notes


def calibrate_report(*, shapes, device, dtypes: list[str], batch_size: int, warmup: int, steps: int, profile,
                     sustain: float = 0.0):
    """`plan calibrate`: measure, write the profile, one Report of the measured rates."""
    from lmsys.core.devices import environment
    from lmsys.core.results import Report
    from lmsys.plan.profile import save_profile

    with progress.display("plan calibrate"):
        prof, rows = calibrate(shapes, device=device, dtypes=dtypes, batch_size=batch_size, warmup=warmup, steps=steps,
                               sustain=sustain)
    save_profile(prof, profile)
    notes = [f"Profile written to {profile}; use it with `lmsys plan train --profile {profile}`.",
             *curve_notes(prof), *sustained_notes(prof)]
    if "busbw" not in prof:
        notes.append("All-reduce busbw not measured: fewer than 2 GPUs here (plan train keeps the table's links).")
    else:
        notes.append(f"all-reduce rows: GB/s is busbw (nccl-tests: algbw · 2(n−1)/n), through the job `lmsys comm "
                     f"all-reduce` runs; latency_us = the smallest size's median time, {prof['latency_us']:.1f} µs. "
                     "plan train and validate take collective times from these points.")
    meta = {**environment(device), "model": "; ".join(shape.describe() for shape in shapes)}
    return Report("plan calibrate", rows, meta, notes)
