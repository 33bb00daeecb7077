"""`plan breakdown`: where a training step's time goes, beside what the time model predicts for each part.

For each size and dtype: bench e2e's plain step (what `plan validate` runs: naive attention, eager, AdamW
(fused on a GPU), autocast for bf16; checkpoint none) at `batch_size` sequences. Measured with
lmsys.core.timing:
- the step: the median of `steps` timed steps after `warmup` (the region timer);
- the host's issue time: the host clock around one step started from an empty queue, not waiting for the
  device (the median of 3): the host's own cost when the device keeps up, bounded by the device's pace
  when the queue fills;
- the step's kernels (`kernel_times`: torch.profiler over 2 steps, per step), summed by kind (`KINDS`,
  `kind_of` by kernel name), and the largest by name.
Predicted by plan.time.step_time from a `plan calibrate` profile (the parts it counts: the matmuls at the
profile's per-shape rates, the elementwise bytes at its elementwise rate, AdamW at its optimizer rate, the
host's ops × µs an op). On a CPU there are no kernels: the profiler's top-level CPU ops stand in, each with
its host dispatch, labelled so in every row and note (the model adds its host term apart, the host being
the device there).
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Optional

from lmsys.core import progress

KINDS = ("GEMM", "attention", "elementwise", "optimizer", "communication", "the rest")
# the first pattern that matches a kernel's (GPU) or a top-level op's (CPU) name gives its kind; the order
# matters: memory-efficient attention's kernels are CUTLASS ones, AdamW's foreach ops are aten ops
PATTERNS = (
    ("communication", re.compile(r"nccl|gloo|c10d::|allreduce|all_reduce|allgather|all_gather|reduce_scatter", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|adam|Optimizer\.", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|splitK|aten::(linear|mm|addmm|bmm|baddbmm|matmul)$"
                        r"|: (Mm|Addmm|Bmm|BaddBmm|Matmul|Linear)Backward", re.I)),
    ("elementwise", re.compile(r"at::native|triton_|elementwise|vectorized|reduce|softmax|norm|copy|aten::"
                               r"|autograd::engine", re.I)),
)


def kind_of(name: str) -> str:
    """The kind (`KINDS`) of a kernel or op by its name: matmuls (cuBLAS, CUTLASS and nvjet kernels; on a
    CPU aten's matmul ops and their backward nodes), fused attention, PyTorch's own kernels (elementwise,
    reductions, norms, softmax, casts and copies: what the time model counts in bytes), the optimizer's
    multi-tensor kernels, collectives, and the rest (memsets, host-device copies)."""
    for kind, pattern in PATTERNS:
        if pattern.search(name):
            return kind
    return "the rest"


def breakdown(sizes: list[str], *, dtypes: list[str], batch_size: int, device, profile: dict, warmup: int,
              steps: int, context_length: Optional[int] = None, top: int = 10) -> tuple[list[dict], list[dict]]:
    """(rows: per size and dtype, each kind's measured and predicted ms, then the kernels' sum, the host's
    issue time and the step against the model's; kernel rows: the `top` largest kernels (CPU: ops) of each
    step by name, with their kind)."""
    from lmsys.model.config import get_config, resolve_configs
    from lmsys.plan.calibrate import plain_step_options
    from lmsys.plan.shape import from_model_config

    rows: list[dict] = []
    kernel_rows: list[dict] = []
    progress.plan_rows(len(sizes) * len(dtypes))
    for size in sizes:
        for dtype in dtypes:
            progress.start_row(f"{size} {dtype}")
            options = plain_step_options(device, dtype)
            attn_impl = options.pop("attn_impl")
            seq = context_length or get_config(size).context_length
            (name, cfg), = resolve_configs([size], context_length=seq, attn_impl=attn_impl)
            shape = from_model_config(cfg, name=name)
            measured = measure_step(cfg, name=name, options=options, batch_size=batch_size, dtype=dtype,
                                    device=device, warmup=warmup, steps=steps)
            predicted = predict_parts(shape, profile, dtype=dtype, batch_size=batch_size)
            rows += compare(measured, predicted, size=name, dtype=dtype, cpu=device.type != "cuda")
            named = sorted(measured["kernels"].items(), key=lambda kv: -kv[1])[:top]
            kernel_rows += [{"size": name, "dtype": dtype, "kernel" if device.type == "cuda" else "op": k[:100],
                             "kind": kind_of(k), "ms": ms} for k, ms in named]
    return rows, kernel_rows


def measure_step(cfg, *, name: str, options: dict, batch_size: int, dtype: str, device, warmup: int,
                 steps: int) -> dict:
    """{"step": Stats of the train step, "issue ms": the host's time to issue one step from an empty queue
    (median of 3), "kernels": {name: ms per step}} for bench e2e's step of `cfg` (checkpoint none)."""
    from lmsys.bench import e2e
    from lmsys.core.timing import kernel_times, synchronize, time_fn
    from lmsys.train.build import build_train_step, tf32_matmuls
    from lmsys.train.step import random_batch, run_step

    (_, workload), = e2e.resolve_workloads([(name, cfg)], checkpoints=["none"], batch_size=batch_size,
                                           dtype=dtype, cuda_graphs=False, **options)
    with tf32_matmuls(workload.tf32):
        step = build_train_step(workload, device)
        inputs, targets = random_batch(workload, device)

        def train():
            run_step(step, inputs, targets, mode="train")

        stats = time_fn(train, warmup=warmup, steps=steps, device=device)
        issue = []
        for _ in range(3):
            synchronize(device)
            t0 = time.perf_counter()
            train()
            issue.append((time.perf_counter() - t0) * 1e3)
        kernels = kernel_times(train, warmup=0, steps=2, device=device)
    del step, inputs, targets  # free the model before the next row
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    return {"step": stats, "issue ms": statistics.median(issue), "kernels": kernels}


def predict_parts(shape, profile: dict, *, dtype: str, batch_size: int) -> dict:
    """The time model's ms of one step of `shape` (one process, checkpoint none) by kind, as `kind_of`
    sorts kernels: GEMM (the blocks' and the head's matmuls; naive attention's s×s products too, which run
    as GEMM kernels), attention (a fused kernel's), elementwise (the rest of the compute: the bytes the
    model counts at the elementwise rate), optimizer, communication; then the device's sum, the host's
    ops × µs an op, and the step's total."""
    from lmsys.plan import memory as mem
    from lmsys.plan.shape import block_gemms, head_gemm
    from lmsys.plan.time import block_cost, step_time
    from lmsys.plan.validate import rates_for

    rates = rates_for(profile, dtype)
    prec = mem.precision(dtype, master_weights=False)  # autocast over fp32 weights, as bench e2e
    lay = mem.Layout(micro_batch=batch_size)
    st = step_time(shape, lay, prec, rates, gpus_per_node=1)
    bc = block_cost(shape, b=batch_size, t=1, sp=False, prec=prec, rates=rates)
    tokens = batch_size * shape.seq
    gemms = sum(rates.matmul_ms(M, K, N) + rates.matmul_ms(M, K, N, backward=True)
                for _, M, K, N in block_gemms(shape, tokens=tokens, tp=1))
    attn = bc.matmul_fwd + bc.matmul_bwd - gemms  # the s×s products, or the fused kernel
    fused = shape.attention == "flash"
    _, M, K, N = head_gemm(shape, tokens=tokens, tp=1)
    gemm = shape.layers * (gemms + (0.0 if fused else attn)) + rates.matmul_ms(M, K, N) \
        + rates.matmul_ms(M, K, N, backward=True)
    attention = shape.layers * attn if fused else 0.0
    communication = st.tp_comm + st.pp_comm + st.dp_comm
    device = st.compute + st.recompute + st.optimizer + communication
    host = st.parts["host fwd ms"] + st.parts["host bwd ms"] + st.parts["host optimizer ms"]
    return {"GEMM": gemm, "attention": attention, "elementwise": st.compute + st.recompute - gemm - attention,
            "optimizer": st.optimizer, "communication": communication, "the rest": None, "device": device,
            "host": host, "step": st.total, "bound": "host" if st.host > 0 else "device"}


def compare(measured: dict, predicted: dict, *, size: str, dtype: str, cpu: bool) -> list[dict]:
    """Rows of one step: each kind, the kernels' (CPU: ops') sum, the host's issue time, the step."""
    by_kind = dict.fromkeys(KINDS, 0.0)
    for kernel, ms in measured["kernels"].items():
        by_kind[kind_of(kernel)] += ms
    what = "CPU ops" if cpu else "kernels"
    rows = [(f"{kind} {what}", by_kind[kind], predicted[kind]) for kind in KINDS]
    rows.append((f"{what}, all", sum(by_kind.values()), predicted["device"]))
    # a CPU: the host is the device, its issue time is the step (no row of its own)
    rows.append(("host issue", None if cpu else measured["issue ms"], predicted["host"]))
    rows.append((f"step ({predicted['bound']}-bound in the model)", measured["step"].median, predicted["step"]))
    return [{"size": size, "dtype": dtype, "part": part, "measured ms": m, "predicted ms": p,
             "error %": None if not m or p is None else 100 * (p - m) / m} for part, m, p in rows]


def run_breakdown(sizes: list[str], *, dtypes: list[str], batch_size: int, device, profile: Optional[dict],
                  profile_path: Optional[str], warmup: int, steps: int, context_length: Optional[int] = None,
                  top: int = 10) -> list:
    """`plan breakdown`'s two reports (core.results.Report): the parts against the model, the largest
    kernels. Without a profile, `plan calibrate` of `sizes` runs here first (no all-reduce: one process)."""
    from lmsys.core.devices import environment
    from lmsys.core.results import Report

    notes = []
    if profile is None:
        from lmsys.plan.calibrate import calibrate
        from lmsys.plan.shape import load_shape

        shapes = [load_shape(s) for s in dict.fromkeys(sizes)]
        if context_length is not None:
            from dataclasses import replace

            shapes = [replace(shape, seq=context_length) for shape in shapes]
        profile, _ = calibrate(shapes, device=device, dtypes=dtypes, batch_size=batch_size, warmup=2, steps=5,
                               collectives=False)
        source = f"calibrated here first (plan calibrate --size {','.join(sizes)} --batch-size {batch_size})"
        notes.append("predicted: from a calibration run here first; `lmsys plan calibrate --profile FILE` once and "
                     "`--profile FILE` here reuse one.")
    else:
        source = f"{profile_path} ({profile['device']})"
    rows, kernel_rows = breakdown(sizes, dtypes=dtypes, batch_size=batch_size, device=device, profile=profile,
                                  warmup=warmup, steps=steps, context_length=context_length, top=top)
    cpu = device.type != "cuda"
    run = (f"bench e2e's plain step (naive attention, eager, AdamW{'' if cpu else ' fused'}, autocast for 16-bit "
           f"dtypes; checkpoint none), batch {batch_size}, {warmup} warm-up + {steps} timed steps; 2 more under "
           "torch.profiler")
    meta = {**environment(device), "profile": source, "run": run}
    if cpu:
        notes.insert(0, "A CPU has no kernels: the measured parts are torch.profiler's top-level CPU ops by kind, "
                        "each op's host dispatch included (its Python between ops is not in them). The "
                        "model's parts are its compute at the profile's rates; it adds its host term (ops × "
                        "µs an op) to the step apart, the host being the device here, so no `host issue` row.")
    else:
        notes.insert(0, "measured parts: the device's kernels over 2 profiled steps (torch.profiler), per step, "
                        "summed by kind from their names; `kernels, all` is the device's busy time, gaps left out.")
        notes.append("host issue: the host clock around one step from an empty queue, not waiting for the device "
                     "(median of 3): the host's own time where the device keeps up; where the device is slower the "
                     "queue fills and it reads the device's pace. The model's: dispatched ops × the profile's µs an "
                     "op. The step is the longer of host and device in the model (one stage: the host queues ahead).")
    notes.append("GEMM: the blocks' and the LM head's matmuls, naive attention's s×s products too (they run as GEMM "
                 "kernels); attention: fused attention kernels; elementwise: PyTorch's own kernels (elementwise, "
                 "reductions, norms, softmax, casts, copies: the bytes the model counts at its elementwise rate); "
                 "optimizer: AdamW; communication: collectives (none on one process); the rest: what no pattern "
                 "names (memsets, host-device copies), not predicted. step: the timer's median against the model's "
                 "total.")
    what = "op" if cpu else "kernel"
    return [Report("plan breakdown", rows, meta, notes),
            Report(f"plan breakdown: the largest {what}s", kernel_rows, meta,
                   [f"ms per step of each {what} name (all its calls), the {top} largest of each row; kind as above."])]


def resolve(*, size: Optional[str], dtype: Optional[str], batch_size: int, context_length: Optional[int], profile,
            warmup: int, steps: int, top: int, device: str) -> dict:
    """`plan breakdown`'s options checked (the torch-free ones first), as `run_breakdown`'s arguments."""
    from lmsys.core.devices import check_dtype_for_device, resolve_device
    from lmsys.core.parsing import check_counts, check_dtypes, parse_list
    from lmsys.model.config import get_config

    check_counts(batch_size=(batch_size, 1), warmup=(warmup, 0), steps=(steps, 1), top=(top, 1))
    if context_length is not None:
        check_counts(context_length=(context_length, 1))
    dtypes = check_dtypes(dtype) if dtype else None
    prof = None
    if profile is not None:
        from lmsys.plan.profile import load_profile

        prof = load_profile(profile)
    dev = resolve_device(device)
    sizes = parse_list(size, str, what="--size") if size else (["xl", "2.7b"] if dev.type == "cuda" else ["tiny"])
    for s in sizes:
        get_config(s)  # a bad preset or .yaml: one line now
    dtypes = dtypes or (["bf16", "fp32"] if dev.type == "cuda" else ["fp32"])
    for d in dtypes:
        check_dtype_for_device(d, dev)
    return dict(sizes=sizes, dtypes=dtypes, batch_size=batch_size, device=dev, profile=prof,
                profile_path=str(profile) if profile else None, warmup=warmup, steps=steps,
                context_length=context_length, top=top)


def breakdown_reports(**resolved) -> list:
    """`plan breakdown`: `run_breakdown(**resolve(...))` under the progress display."""
    with progress.display("plan breakdown"):
        return run_breakdown(resolved.pop("sizes"), **resolved)
