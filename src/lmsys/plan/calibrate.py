"""`plan calibrate` and `plan validate`: measure this machine's rates, and hold predictions against runs.

Calibration times, with lmsys.core.timing's timer: the model's GEMM shapes per dtype (TFLOP/s over all of
them), attention forward + backward at the model's heads and sequence (naive s×s scores for lmsys's naive
attention, SDPA otherwise), a large copy (HBM or RAM bandwidth), and on a machine with 2 or more GPUs the
all-reduce busbw per size and world size through lmsys.bench.comm (the job `comm allreduce`
runs). Validation runs `bench e2e`'s library (lmsys.bench.e2e) and predicts each row with the profile.
"""

from __future__ import annotations

from lmsys.core.flops import attention_flops
from lmsys.core.parsing import MiB
from lmsys.core.timing import time_fn
from lmsys.plan.shape import ModelShape

BUSBW_SIZES = (2**20, 2**23, 2**26, 2**28)


def gemm_shapes(m: ModelShape, *, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of the block's and the head's matmuls for `tokens` rows."""
    h = m.d_model
    up = (3 if m.mlp == "swiglu" else 2) - 1
    return [("QKV", tokens, h, h + 2 * m.kv_dim), ("attention out", tokens, h, h), ("MLP in", tokens, h, up * m.d_ff),
            ("MLP out", tokens, m.d_ff, h), ("LM head", tokens, h, m.vocab)]


def calibrate(m: ModelShape, *, device, dtypes: list[str], batch_size: int, warmup: int, steps: int,
              collectives: bool) -> tuple[dict, list[dict]]:
    """(profile, rows): the rates the time model uses, and one row per measurement."""
    import torch

    from lmsys.core.devices import device_name, torch_dtype

    rows: list[dict] = []
    profile: dict = {"device": device_name(device), "matmul_tflops": {}, "attention_tflops": {}}
    tokens = batch_size * m.seq
    for dtype in dtypes:
        dt = torch_dtype(dtype)
        total_flops = total_ms = 0.0
        for name, M, K, N in gemm_shapes(m, tokens=tokens):
            a = torch.randn(M, K, device=device, dtype=dt)
            b = torch.randn(K, N, device=device, dtype=dt)
            ms = time_fn(lambda: a @ b, warmup=warmup, steps=steps, device=device).median
            flops = 2.0 * M * K * N
            total_flops, total_ms = total_flops + flops, total_ms + ms
            rows.append({"what": f"matmul {name}", "dtype": dtype, "shape": f"{M}×{K}·{K}×{N}",
                         "ms": ms, "TFLOP/s": flops / (ms * 1e-3) / 1e12})
        profile["matmul_tflops"][dtype] = total_flops / (total_ms * 1e-3) / 1e12
        ms, flops, label = _attention(m, device=device, dt=dt, batch=batch_size, warmup=warmup, steps=steps)
        profile["attention_tflops"][dtype] = flops / (ms * 1e-3) / 1e12
        rows.append({"what": f"attention {label} fwd+bwd", "dtype": dtype,
                     "shape": f"b{batch_size} h{m.heads} s{m.seq} d{m.d_head}", "ms": ms,
                     "TFLOP/s": profile["attention_tflops"][dtype]})
    numel = (256 if device.type == "cuda" else 32) * MiB // 4
    x = torch.empty(numel, device=device, dtype=torch.float32).normal_()
    y = torch.empty_like(x)
    ms = time_fn(lambda: y.copy_(x), warmup=warmup, steps=steps, device=device).median
    profile["hbm_GBps"] = 2 * x.numel() * 4 / (ms * 1e-3) / 1e9  # read + write
    rows.append({"what": "memory copy", "dtype": "fp32", "shape": f"{x.numel() * 4 // MiB} MiB", "ms": ms,
                 "GB/s": profile["hbm_GBps"]})
    if collectives:
        profile["busbw"] = {}
        for n, points in _busbw(dtypes[-1], warmup=warmup, steps=steps).items():
            profile["busbw"][n] = points
            rows += [{"what": f"all-reduce on {n} GPUs", "dtype": dtypes[-1], "shape": f"{size // MiB} MiB",
                      "GB/s": bw} for size, bw in points.items()]
    return profile, rows


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


def _busbw(dtype: str, *, warmup: int, steps: int) -> dict:
    """{world size: {bytes: busbw GB/s}} for all-reduce on 2, 4, 8 ... GPUs of this machine."""
    import torch

    from lmsys.distributed import launch

    out: dict = {}
    n = 2
    while n <= torch.cuda.device_count():
        result = launch.run("lmsys.bench.comm:collective_job",
                            dict(collective="all-reduce", sizes=list(BUSBW_SIZES), labels=[str(s) for s in BUSBW_SIZES],
                                 dtype=dtype, warmup=warmup, iters=steps, baseline=False),
                            world_size=n, backend="nccl")
        if result is None:
            return out
        out[n] = {size: row["busbw GB/s"] for size, row in zip(BUSBW_SIZES, result["rows"]) if row.get("busbw GB/s")}
        n *= 2
    return out


# ------------------------------------------------------------------------------------------ validate

def validate(*, sizes: list[str], dtypes: list[str], checkpoints: list[str], batch_size: int, warmup: int,
             steps: int, device, profile: dict) -> tuple[list[dict], dict]:
    """Run bench e2e (mode train) over sizes × dtypes × checkpoint policies and predict each row with
    `profile`. Returns (rows, summary {mean/max |error| % of step time and memory})."""
    from lmsys.bench import e2e
    from lmsys.model.config import resolve_configs
    from lmsys.core.parsing import MiB as _MiB
    from lmsys.plan import memory as mem
    from lmsys.plan.profile import rates as profile_rates
    from lmsys.plan.shape import from_model_config
    from lmsys.plan.time import step_time

    rows: list[dict] = []
    for dtype in dtypes:
        options = e2e.step_options(device, dtype, fast=False, attn=None, compile_scope=None, optimizer="auto",
                                   master_weights=False, fused_ce="off", tf32=False)
        attn_impl = options.pop("attn_impl")
        for size in sizes:
            (name, cfg), = resolve_configs([size], context_length=_context(size), attn_impl=attn_impl)
            workloads = e2e.resolve_workloads([(name, cfg)], checkpoints=checkpoints, batch_size=batch_size,
                                              dtype=dtype, cuda_graphs=False, **options)
            measured = list(e2e.run_e2e(workloads, modes=["train"], warmup=warmup, steps=steps, device=device))
            for (_, workload), got in zip(workloads, measured):
                shape = from_model_config(cfg, name=name)
                lay = mem.Layout(micro_batch=batch_size, checkpoint="full" if workload.checkpoint != "none" else "none")
                prec = mem.precision(dtype, master_weights=False)
                st = step_time(shape, lay, prec, profile_rates(profile, dtype), gpus_per_node=1)
                predicted_mem = mem.memory(shape, lay, prec, capacity=float("inf")).total
                ms = got["ms/step"].mean if got.get("status") == "ok" else None
                peak = got.get("peak step MiB")
                rows.append({
                    "size": name, "dtype": dtype, "checkpoint": workload.checkpoint,
                    "predicted ms": st.total, "measured ms": ms, "time error %": _err(st.total, ms),
                    "predicted MiB": predicted_mem / _MiB, "measured MiB": peak,
                    "memory error %": _err(predicted_mem / _MiB, peak), "status": got.get("status"),
                })
    summary = {}
    for key in ("time error %", "memory error %"):
        errs = [abs(r[key]) for r in rows if r[key] is not None]
        summary[key] = (sum(errs) / len(errs), max(errs)) if errs else None
    return rows, summary


def _context(size: str) -> int:
    from lmsys.model.config import get_config

    return get_config(size).context_length


def _err(predicted: float, measured: float | None) -> float | None:
    return None if measured in (None, 0) else 100 * (predicted - measured) / measured
