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
--pairs N instead alternates the host twins (calibrate's; with --deep also at the model's depth) with N runs of 10 timed steps per row and predicts each run from the twins around it:
does a twin track the host's speed of the moment?
The answers it gave on an H200 are in docs/benchmarks/plan.md ("Where a bench e2e step's time goes", and
"The host-bound rows against the host of the moment").
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


def pairs(size: str, dtype: str, *, shape, profile: dict, batch: int, n: int, device, deep: bool) -> None:
    """Twins, 10 timed steps, twins, ... (n step runs) of bench e2e's plain step at checkpoint none. The
    twins: plan calibrate's (`idle`) and, with `deep`, calibrate's at the model's depth (`deep`: the model's
    blocks less 4 against all of them, a host working set as large as the step's). Each run's median beside
    its prediction from calibrate's twin before it, the mean of the two around it (what plan validate's
    `beside` does), the median of all of them, and from the deep twin after it and the deep twins' median.
    (A twin issued behind a sleeping kernel, a busy device, was tried on 2026-12-04 and did not track the
    step: docs/benchmarks/plan.md; commit 6c99b80 has it.)"""
    import statistics

    from lmsys.bench import e2e
    from lmsys.model.config import get_config, resolve_configs
    from lmsys.plan import memory as mem
    from lmsys.plan.calibrate import measure_host, plain_step_options
    from lmsys.plan.time import step_time
    from lmsys.plan.validate import rates_for
    from lmsys.train.build import build_train_step, tf32_matmuls
    from lmsys.train.step import random_batch

    options = plain_step_options(device, dtype)
    attn = options.pop("attn_impl")
    (name, cfg), = resolve_configs([size], context_length=get_config(size).context_length, attn_impl=attn)
    (_, workload), = e2e.resolve_workloads([(name, cfg)], checkpoints=["none"], batch_size=batch, dtype=dtype,
                                           cuda_graphs=False, **options)
    prec = mem.precision(dtype, master_weights=False)

    def predict(us: float) -> float:
        p = {**profile, "launch_us": {**profile["launch_us"], dtype: us}}
        return step_time(shape, mem.Layout(micro_batch=batch), prec, rates_for(p, dtype), gpus_per_node=1).total

    def twins() -> dict:
        got = {"idle": measure_host(shape, device=device, dtype=dtype, warmup=2, steps=20)[0]}
        if deep and shape.layers > 1:
            got["deep"] = measure_host(shape, device=device, dtype=dtype, warmup=2, steps=20, recompute=False,
                                       blocks=(max(1, shape.layers - 4), shape.layers))[0]
        return got

    seen, runs = [twins()], []
    with tf32_matmuls(workload.tf32):
        step = build_train_step(workload, device)
        inputs, targets = random_batch(workload, device)
        for _ in range(n):
            timer, _, _ = e2e.timed_steps(step, inputs, targets, mode="train", warmup=2, steps=10, device=device)
            runs.append(timer.stats()["step"].median)
            seen.append(twins())
    del step
    idle = [t["idle"] for t in seen]
    ways = {"idle before": lambda i: idle[i], "idle beside": lambda i: (idle[i] + idle[i + 1]) / 2,
            "idle median": lambda i: statistics.median(idle)}
    if "deep" in seen[0]:
        ways["deep after"] = lambda i: seen[i + 1]["deep"]
        ways["deep median"] = lambda i: statistics.median(t["deep"] for t in seen)
    print(f"\n== pairs: {size} {dtype}, batch {batch}; device-only model {predict(0.1):.1f} ms; twins µs/op "
          + "; ".join(f"{k}: " + ", ".join(f"{t[k]:.2f}" for t in seen) for k in seen[0]))
    print("run | measured ms | error % with: " + " | ".join(ways))
    errs = {k: [] for k in ways}
    for i, ms in enumerate(runs):
        for k, us in ways.items():
            errs[k].append(100 * (predict(us(i)) - ms) / ms)
        print(f"{i} | {ms:.1f} | " + " | ".join(f"{errs[k][-1]:+.1f}" for k in ways))
    print(f"measured ms: median {statistics.median(runs):.1f}, min {min(runs):.1f}, max {max(runs):.1f}; "
          "max |error| %: " + ", ".join(f"{k} {max(abs(e) for e in v):.1f}" for k, v in errs.items()))
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
    ap.add_argument("--pairs", type=int, default=0, help="instead: N alternations of the host twin and 10 timed "
                    "steps per row, each step time predicted with the twins on either side (does the twin track "
                    "the host's speed of the moment?)")
    ap.add_argument("--deep", action="store_true", help="with --pairs: also the twin at the model's depth")
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
            if args.pairs:
                pairs(size, dtype, shape=shapes[size], profile=profile, batch=b, n=args.pairs, device=device,
                      deep=args.deep)
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
