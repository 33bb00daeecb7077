"""`bench e2e`: time forward, backward and optimizer of the LM training step over sizes and modes.

Each configuration yields one row per mode; an out-of-memory configuration yields a row marked OOM and
the sweep goes on. Rows are plain dicts (column heading -> value) for lmsys.core.results.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

from lmsys.core.errors import LmsysError
from lmsys.core.flops import mfu, model_flops
from lmsys.core.results import MeanStd
from lmsys.core.timing import RegionTimer, synchronize
from lmsys.model.config import ModelConfig, get_config

MODE_CHOICES = ("fwd", "fwd-bwd", "train", "all")
MiB = 2**20


def default_size(device) -> str:
    """`small` on a GPU; `tiny` on a CPU so that the quick start measures something real in seconds."""
    return "small" if device.type == "cuda" else "tiny"


def resolve_configs(sizes: list[str], *, context_length: int, vocab_size: int | None = None,
                    d_model: int | None = None, d_ff: int | None = None, layers: int | None = None,
                    heads: int | None = None, attn_impl: str = "naive") -> list[tuple[str, ModelConfig]]:
    """Preset names (or YAML files) with the command-line overrides applied; all validated up front."""
    from lmsys.kernels.attention import check_impl

    check_impl(attn_impl)
    if context_length < 1:
        raise LmsysError(f"--context-length must be positive, got {context_length}")
    out = []
    for name in sizes:
        cfg = get_config(name).with_overrides(
            d_model=d_model, d_ff=d_ff, num_layers=layers, num_heads=heads, vocab_size=vocab_size,
            context_length=context_length, attn_impl=attn_impl,
        )
        out.append((name, cfg))
    return out


def expand_modes(mode: str) -> list[str]:
    if mode not in MODE_CHOICES:
        raise LmsysError(f"--mode must be one of {', '.join(MODE_CHOICES)}, not {mode!r}")
    return ["fwd", "fwd-bwd", "train"] if mode == "all" else [mode]


def describe(cfg: ModelConfig) -> str:
    return (f"d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
            f"vocab {cfg.vocab_size}, context {cfg.context_length}")


def run_e2e(configs: list[tuple[str, ModelConfig]], *, modes: list[str], batch_size: int, dtype: str,
            compile: bool, warmup: int, steps: int, device) -> Iterator[dict]:
    """Yield one row per (configuration, mode)."""
    from lmsys.core.devices import free_memory, is_oom
    from lmsys.model import count_parameters

    for name, cfg in configs:
        params = count_parameters(cfg)
        rows: list[dict] = []
        try:
            for row in _measure_config(name, cfg, params, modes=modes, batch_size=batch_size,
                                       dtype=dtype, compile=compile, warmup=warmup, steps=steps,
                                       device=device):
                rows.append(row)
        except Exception as exc:  # noqa: BLE001 - only OOM is swallowed, below
            if not is_oom(exc):
                raise
            done = {r["mode"] for r in rows}
            rows += [_oom_row(name, params, m) for m in modes if m not in done]
        free_memory(device)
        yield from rows


def _oom_row(name: str, params: int, mode: str) -> dict:
    return {"size": name, "mode": mode, "params": params, "status": "OOM"}


def _measure_config(name, cfg, params, *, modes, batch_size, dtype, compile, warmup, steps, device):
    from lmsys.bench.step import Workload, build_train_step, random_batch
    from lmsys.core.devices import peak_memory, peak_tflops, reset_peak_memory

    workload = Workload(cfg, batch_size=batch_size, dtype=dtype, compile=compile)
    step = build_train_step(workload, device)
    inputs, targets = random_batch(workload, device)
    peak = peak_tflops(device, dtype)
    for mode in modes:
        for _ in range(warmup):
            step.run(inputs, targets, mode)
        synchronize(device)
        timer = RegionTimer(device)
        peak_fwd = peak_step = None
        for _ in range(steps):
            step.zero_grad()
            reset_peak_memory(device)
            with timer.region("step"):
                with timer.region("forward"):
                    loss = step.forward(inputs, targets)
                peak_fwd = _max(peak_fwd, peak_memory(device))
                if mode != "fwd":
                    with timer.region("backward"):
                        step.backward(loss)
                if mode == "train":
                    with timer.region("optimizer"):
                        step.optimizer_step()
            del loss
            peak_step = _max(peak_step, peak_memory(device))
        stats = timer.stats()
        step_ms = stats["step"].mean
        flops = model_flops(cfg, batch_size=batch_size, seq_len=cfg.context_length, backward=mode != "fwd")
        util = mfu(flops, step_ms, peak)
        yield {
            "size": name,
            "mode": mode,
            "params": params,
            "forward ms": _cell(stats.get("forward")),
            "backward ms": _cell(stats.get("backward")),
            "optimizer ms": _cell(stats.get("optimizer")),
            "step ms": _cell(stats["step"]),
            "tokens/s": workload.tokens / (step_ms * 1e-3),
            "MFU %": None if util is None else 100 * util,
            "peak fwd MiB": None if peak_fwd is None else peak_fwd / MiB,
            "peak step MiB": None if peak_step is None else peak_step / MiB,
            "status": "ok",
        }


def _cell(stats) -> MeanStd | None:
    return None if stats is None else MeanStd(stats.mean, stats.std)


def _max(a, b):
    if b is None:
        return a
    return b if a is None else max(a, b)
