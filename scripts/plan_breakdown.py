"""Where a bench e2e step's time goes, beside what lmsys plan's time model predicts for each part.

For each size and dtype: bench e2e's plain step (what `plan validate` runs: naive attention, eager, fused
AdamW, autocast for bf16) at --batch-size, checkpoint none. It prints
- the step's median over 8 timed steps (lmsys's timer) and its forward / backward / optimizer regions;
- the host's time to issue one step from an empty queue (the host's own cost when the device keeps up);
- the device's kernels over two profiled steps (torch.profiler), GEMMs (cuBLAS/CUTLASS names) apart from
  the rest, the fused AdamW's multi-tensor kernel apart, the largest others by name;
- the model's device time (GEMMs and s×s products, the rest, AdamW), host time and total, from --profile
  (a `plan calibrate` profile) or from a calibration of --sizes run first (written to $OUT/profile.json);
- the SM clock and power while each row ran (nvidia-smi, 5 samples a second).
--interleave N instead runs N rounds of one step and one step of each host twin (`interleave`): does a
twin of the same second track the host's speed, and which twin?
The answers it gave on an H200 are in docs/benchmarks/plan.md ("Where a bench e2e step's time goes", and
"The host-bound rows against the host of the moment", "The host-bound rows do not repeat").
A device diagnostic, not part of the package. From the repository root, on a GPU machine:

    PYTHONPATH=src OUT=/tmp/out python3 scripts/plan_breakdown.py --sizes xl,2.7b --dtypes bf16,fp32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import threading
import time

import torch

GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.I)
ADAMW = "multi_tensor_apply"


class Clocks:
    """SM clock and power sampled in the background, labelled by what runs."""

    def __init__(self):
        self.label, self.samples = "idle", []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
        while True:
            try:
                mhz, watts = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout.split(",")[:2]
                self.samples.append((self.label, float(mhz), float(watts)))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            time.sleep(0.2)

    def summary(self, label: str) -> str:
        mine = [(c, w) for lab, c, w in self.samples if lab == label]
        if not mine:
            return "no clock samples"
        mhz, watts = sorted(c for c, _ in mine), sorted(w for _, w in mine)
        return f"SM {mhz[len(mhz) // 2]:.0f} MHz (min {mhz[0]:.0f}), {watts[len(watts) // 2]:.0f} W (max {watts[-1]:.0f})"


def kernels(fn, device, steps: int = 2) -> tuple[float, float, float, dict]:
    """(GEMM ms, AdamW ms, other ms, {other kernel name: ms}) per call of `fn`, from the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from lmsys.core.timing import synchronize

    cuda = device.type == "cuda"  # a CPU (a smoke run of this script): its ops, nested, stand in for kernels
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        synchronize(device)
    gemm = adamw = 0.0
    other: dict = {}
    for e in prof.events():
        if e.device_type != (DeviceType.CUDA if cuda else DeviceType.CPU):
            continue
        ms = e.time_range.elapsed_us() / 1e3 / steps
        if GEMM.search(e.name):
            gemm += ms
        elif ADAMW in e.name:
            adamw += ms
        else:
            other[e.name] = other.get(e.name, 0.0) + ms
    return gemm, adamw, sum(other.values()), other


def measure(workload, device) -> tuple[dict, float, tuple]:
    """({region: median ms} over 8 timed steps, the host's ms to issue one step from an empty queue (the
    median of 3), `kernels` of a step) for bench e2e's step of `workload`."""
    from lmsys.core.timing import RegionTimer, synchronize
    from lmsys.train.build import build_train_step, tf32_matmuls
    from lmsys.train.step import random_batch, run_step

    with tf32_matmuls(workload.tf32):
        step = build_train_step(workload, device)
        inputs, targets = random_batch(workload, device)

        def train():
            return run_step(step, inputs, targets, mode="train")

        for _ in range(3):
            train()
        synchronize(device)
        timer = RegionTimer(device)
        for _ in range(8):
            run_step(step, inputs, targets, mode="train", range_fn=timer.region)
        median = {k: v.median for k, v in timer.stats().items()}
        issue = []
        for _ in range(3):
            synchronize(device)
            t0 = time.perf_counter()
            train()
            issue.append((time.perf_counter() - t0) * 1e3)
        synchronize(device)
        return median, sorted(issue)[1], kernels(train, device)


def host_us(shape, device, dtype: str, batch: int) -> tuple[float, float]:
    """(µs an op of the host twin plan calibrate uses: the model's width, 16 tokens; the same difference of
    1- and 3-block steps (forward and backward) at the step's own tokens, each timed on the host from an
    empty queue): does an op cost the host more when its tensors are the step's size?"""
    import statistics

    from lmsys.core.timing import synchronize
    from lmsys.plan.calibrate import _tiny_step, measure_host
    from lmsys.train.step import run_step

    us16, _, ops, _ = measure_host(shape, device=device, dtype=dtype, warmup=2, steps=20)
    issue = {}
    for layers in (1, 3):
        step, inputs, targets = _tiny_step(shape, layers=layers, checkpoint="none", device=device, dtype=dtype,
                                           width="model", seq=shape.seq, batch=batch)
        times = []
        for i in range(7):
            synchronize(device)
            t0 = time.perf_counter()
            run_step(step, inputs, targets, mode="fwd-bwd")
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
        synchronize(device)
        issue[layers] = statistics.median(times)
    return us16, (issue[3] - issue[1]) * 1e3 / (2 * (ops["fwd_layer"] + ops["bwd_layer"]))


def interleave(size: str, dtype: str, *, shape, profile: dict, batch: int, n: int, device) -> None:
    """n rounds, each one step of bench e2e's plain step (checkpoint none) followed at once by one forward
    and backward of each host twin, so that the twins see the host of the same second as the step they
    predict. Every call is timed alone, from an empty queue to the end of its device work (not back to back
    as bench e2e's steps and `measure_host`'s twins are). The twins:
    - `calib`: plan calibrate's shapes (2 and 6 blocks at the model's width, 16 tokens, differenced);
    - `deep`: the model's own depth and width at 16 tokens, its whole time over its ops (a host working
      set as large as the step's: Python objects, autograd nodes, allocator blocks);
    - `tokens`: 1 and 3 blocks at the step's own batch and context, differenced (tensors of the step's
      sizes; the device's time is no longer negligible there and counts too).
    The rounds run twice: with Python's garbage collector on (as bench e2e runs) and off. Each round's
    measured ms beside its prediction from each twin, the medians, and the host's load average and the
    share of CPU time the hypervisor took (steal). Earlier forms of this (twins seconds apart from runs of
    10 steps, a twin behind a busy device) are in docs/benchmarks/plan.md; commit 0083cd4 has them."""
    import gc
    import statistics

    from lmsys.bench import e2e
    from lmsys.core.timing import synchronize
    from lmsys.model.config import get_config, resolve_configs
    from lmsys.plan import memory as mem
    from lmsys.plan.calibrate import _tiny_step, host_ops, plain_step_options
    from lmsys.plan.time import step_time
    from lmsys.plan.validate import rates_for
    from lmsys.train.build import build_train_step, tf32_matmuls
    from lmsys.train.step import random_batch, run_step

    options = plain_step_options(device, dtype)
    attn = options.pop("attn_impl")
    (name, cfg), = resolve_configs([size], context_length=get_config(size).context_length, attn_impl=attn)
    (_, workload), = e2e.resolve_workloads([(name, cfg)], checkpoints=["none"], batch_size=batch, dtype=dtype,
                                           cuda_graphs=False, **options)
    prec = mem.precision(dtype, master_weights=False)
    ops, _ = host_ops(shape, device=device, dtype=dtype)
    per_block = ops["fwd_layer"] + ops["bwd_layer"]
    deep_ops = shape.layers * per_block + ops["fwd_other"] + ops["bwd_other"]

    def predict(us: float) -> float:
        p = {**profile, "launch_us": {**profile["launch_us"], dtype: us}, "ops": {**profile.get("ops", {}), dtype: ops}}
        return step_time(shape, mem.Layout(micro_batch=batch), prec, rates_for(p, dtype), gpus_per_node=1).total

    def timed(fn) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    twins = {}
    for key, layers, kw in (("calib", 2, {}), ("calib", 6, {}), ("deep", shape.layers, {}),
                            ("tokens", 1, dict(seq=shape.seq, batch=batch)),
                            ("tokens", 3, dict(seq=shape.seq, batch=batch))):
        twins[key, layers] = _tiny_step(shape, layers=layers, checkpoint="none", device=device, dtype=dtype,
                                        width="model", **kw)

    def twin(key, layers) -> float:
        t, i, y = twins[key, layers]
        return timed(lambda: run_step(t, i, y, mode="fwd-bwd"))

    def where(before: list) -> tuple[float, str]:
        """The host in the round that started at `before` (`_cpu_times()`): the share of the machine's CPU
        time the hypervisor took (steal) and its load average."""
        after = _cpu_times()
        total = sum(after) - sum(before)
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        steal = 100 * (after[7] - before[7]) / max(total, 1)
        return steal, f"steal {steal:.1f} %, load {load}"

    with tf32_matmuls(workload.tf32):
        step = build_train_step(workload, device)
        inputs, targets = random_batch(workload, device)
        for _ in range(3):
            run_step(step, inputs, targets, mode="train")
            for key, layers in twins:
                twin(key, layers)
        print(f"\n== interleave: {size} {dtype}, batch {batch}; device-only model {predict(0.1):.1f} ms; "
              f"ops {deep_ops} a step's forward and backward")
        for collector in ("gc on", "gc off"):
            if collector == "gc off":
                gc.collect()
                gc.disable()
            rows = []
            try:
                for r in range(n):
                    before = _cpu_times()
                    ms = timed(lambda: run_step(step, inputs, targets, mode="train"))
                    us = {"calib": (twin("calib", 6) - twin("calib", 2)) * 1e3 / (4 * per_block),
                          "deep": twin("deep", shape.layers) * 1e3 / deep_ops,
                          "tokens": (twin("tokens", 3) - twin("tokens", 1)) * 1e3 / (2 * per_block)}
                    rows.append((ms, us, where(before)))
            finally:
                gc.enable()
            print(f"-- {collector}: round | measured ms | predicted ms (error %) from the twin of the same round: "
                  "calib | deep | tokens | µs/op calib, deep, tokens | host")
            for r, (ms, us, host) in enumerate(rows):
                print(f"{r} | {ms:.1f} | " + " | ".join(f"{predict(u):.1f} ({100 * (predict(u) - ms) / ms:+.1f})"
                                                     for u in us.values())
                      + " | " + ", ".join(f"{u:.2f}" for u in us.values()) + f" | {host[1]}")
            measured = [m for m, _, _ in rows]
            med = statistics.median(measured)
            line = []
            for k in rows[0][1]:
                errs = [100 * (predict(u[k]) - m) / m for m, u, _ in rows]
                mu = statistics.median(u[k] for _, u, _ in rows)
                line.append(f"{k}: median twin {mu:.2f} µs/op -> {predict(mu):.1f} ms ({100 * (predict(mu) - med) / med:+.1f} %), "
                            f"per round |error| median {statistics.median(abs(e) for e in errs):.1f} max "
                            f"{max(abs(e) for e in errs):.1f}, corr {_corr(measured, [u[k] for _, u, _ in rows]):+.2f}")
            print(f"measured: median {med:.1f} ms, min {min(measured):.1f}, max {max(measured):.1f}; corr with "
                  f"steal {_corr(measured, [h[0] for _, _, h in rows]):+.2f}, steal median "
                  f"{statistics.median(h[0] for _, _, h in rows):.1f} % max {max(h[0] for _, _, h in rows):.1f} %")
            for x in line:
                print("   " + x)
    step = inputs = targets = None  # free the model before the next row
    twins.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cpu_times() -> list:
    """/proc/stat's machine-wide CPU jiffies: user nice system idle iowait irq softirq steal ..."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _corr(xs: list, ys: list) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else 0.0


def main() -> None:
    from lmsys.bench import e2e
    from lmsys.model.config import get_config, resolve_configs
    from lmsys.plan import memory as mem
    from lmsys.plan.calibrate import calibrate, plain_step_options
    from lmsys.plan.profile import load_profile
    from lmsys.plan.shape import from_model_config, head_gemm
    from lmsys.plan.time import block_cost, step_time
    from lmsys.plan.validate import rates_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="xl,2.7b")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--profile", help="a plan calibrate profile (default: calibrate --sizes first)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    ap.add_argument("--interleave", type=int, default=0, help="instead: N rounds of one timed step and one step of "
                    "each host twin (does a twin of the same second track the step? which twin?)")
    args = ap.parse_args()
    sizes, dtypes, b = args.sizes.split(","), args.dtypes.split(","), args.batch_size
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    device = torch.device(args.device)
    clocks = Clocks()
    configs = {s: dict(resolve_configs([s], context_length=get_config(s).context_length))[s] for s in sizes}
    shapes = {s: from_model_config(cfg, name=s) for s, cfg in configs.items()}
    if args.profile:
        profile = load_profile(args.profile)
    else:
        clocks.label = "calibrate"
        profile, _ = calibrate([shapes[s] for s in sizes], device=device, dtypes=dtypes, batch_size=b, warmup=2,
                               steps=5, collectives=False)
        with open(f"{out}/profile.json", "w") as f:
            json.dump(profile, f, indent=1, default=str)
        print(f"calibrated: {clocks.summary('calibrate')}")

    for size in sizes:
        for dtype in dtypes:
            if args.interleave:
                interleave(size, dtype, shape=shapes[size], profile=profile, batch=b, n=args.interleave,
                           device=device)
                continue
            options = plain_step_options(device, dtype)
            attn = options.pop("attn_impl")
            (name, cfg), = resolve_configs([size], context_length=get_config(size).context_length, attn_impl=attn)
            (_, workload), = e2e.resolve_workloads([(name, cfg)], checkpoints=["none"], batch_size=b, dtype=dtype,
                                                   cuda_graphs=False, **options)
            shape, prec = shapes[size], mem.precision(dtype, master_weights=False)
            rates = rates_for(profile, dtype)
            st = step_time(shape, mem.Layout(micro_batch=b), prec, rates, gpus_per_node=1)
            bc = block_cost(shape, b=b, t=1, sp=False, prec=prec, rates=rates)
            _, M, K, N = head_gemm(shape, tokens=b * shape.seq, tp=1)
            matmuls = shape.layers * (bc.matmul_fwd + bc.matmul_bwd) + rates.matmul_ms(M, K, N) \
                + rates.matmul_ms(M, K, N, backward=True)
            host = st.parts["host fwd ms"] + st.parts["host bwd ms"] + st.parts["host optimizer ms"]
            clocks.label = label = f"{size} {dtype}"
            median, issue, (gemm, adamw, other, names) = measure(workload, device)
            twin16, twin_step = host_us(shape, device, dtype, b)
            print(f"\n== {label}, batch {b}: {clocks.summary(label)}")
            print(f"measured: step {median['step']:.1f} ms (forward {median['forward']:.1f}, backward "
                  f"{median['backward']:.1f}, optimizer {median['optimizer']:.1f}); host issue {issue:.1f} ms")
            print(f"kernels:  GEMM {gemm:.1f} + other {other:.1f} + AdamW {adamw:.1f} = {gemm + other + adamw:.1f} ms")
            print(f"model:    matmuls {matmuls:.1f} + other {st.compute + st.recompute - matmuls:.1f} + AdamW "
                  f"{st.optimizer:.1f} = device {st.compute + st.recompute + st.optimizer:.1f} ms; host {host:.1f}; "
                  f"total {st.total:.1f} ({100 * (st.total - median['step']) / median['step']:+.1f} %)")
            print(f"host µs an op: twin at 16 tokens {twin16:.1f}, twin at the step's tokens {twin_step:.1f}, the step "
                  f"itself {issue * rates.launch_us / host:.1f} (profile {rates.launch_us:.1f})")
            for kernel, ms in sorted(names.items(), key=lambda kv: -kv[1])[:10]:
                print(f"   {ms:8.2f} ms  {kernel[:100]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
