"""A calibration profile: the rates `lmsys plan calibrate` measured on one machine, as YAML or JSON.

Keys: device (its name), memory_GB (its memory: a GPU's, or a CPU host's RAM), matmul_tflops and attention_tflops ({dtype: TFLOP/s}), hbm_GBps, busbw
({world size: {bytes: all-reduce busbw GB/s}}: nccl on GPUs, gloo on a CPU) and latency_us (the smallest
all-reduce's time) where measured, and intra_GBps / inter_GBps when known; elementwise_GBps and
optimizer_GBps, block_elementwise_GBps ({dtype: GB/s}: a block's own elementwise kernels over the bytes the time
model counts; a GPU; in place of elementwise_GBps for that dtype), gemm_tflops ({dtype: [[M, K, N, forward, backward TFLOP/s], ...]}: the model's matmuls) and
scores_tflops ({dtype: [[heads × batch, s, d, forward, backward], ...]}: s×s attention's products) where
timed, host_overlap (a GPU: true), threads (a CPU: the threads every rate was measured with),
launch_us ({dtype: µs per dispatched op}), launch_us_recompute ({dtype: µs per op a recomputed block
dispatches again, the checkpoint's Python included}) and ops ({dtype: OpCounts' fields}) where calibrated (an older
profile without them: the HBM rate and the defaults). `rates` turns a profile into the time model's Rates
for one dtype. Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

from typing import TYPE_CHECKING

from lmsys.core.errors import LmsysError
from lmsys.plan.time import OpCounts, Rates

if TYPE_CHECKING:
    from lmsys.core.hardware import GPU

REQUIRED = ("device", "matmul_tflops", "attention_tflops", "hbm_GBps")


def save_profile(profile: dict, path: str | Path) -> None:
    """Write whole, as every lmsys output (core.files: a link written through, a device directly, a failed
    write one line): JSON for .json, YAML otherwise."""
    import yaml

    from lmsys.core.files import write_atomic

    path = Path(path)
    text = json.dumps(profile, indent=2) if path.suffix == ".json" else yaml.safe_dump(profile, sort_keys=False)
    write_atomic(path, text, what="--profile")


def load_profile(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise LmsysError(f"--profile {path}: cannot read it ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise LmsysError(f"--profile {path}: expected a mapping (lmsys plan calibrate writes one)")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise LmsysError(f"--profile {path}: missing {', '.join(missing)} (lmsys plan calibrate writes them)")
    return data


def rates(profile: dict, dtype: str, *, fallback: Rates | None = None) -> Rates:
    """The profile's rates for `dtype`; links the profile did not measure come from `fallback` (the table)."""
    for key in ("matmul_tflops", "attention_tflops"):
        if dtype not in profile[key]:
            raise LmsysError(f"the profile of {profile['device']} has no {key} for {dtype} "
                             f"(measured: {', '.join(profile[key])}); calibrate with --dtype {dtype}")
    intra = profile.get("intra_GBps") or (fallback.intra_GBps if fallback else 0.0)
    inter = profile.get("inter_GBps") or (fallback.inter_GBps if fallback else None)
    busbw = {int(k): {int(s): float(v) for s, v in pts.items()} for k, pts in (profile.get("busbw") or {}).items()}
    return Rates(matmul_tflops=float(profile["matmul_tflops"][dtype]),
                 attention_tflops=float(profile["attention_tflops"][dtype]), hbm_GBps=float(profile["hbm_GBps"]),
                 intra_GBps=intra, inter_GBps=inter, latency_us=float(profile.get("latency_us", 10.0)),
                 source=f"calibrated on {profile['device']}", busbw=busbw,
                 elementwise_GBps=_number((profile.get("block_elementwise_GBps") or {}).get(dtype,
                                                                                      profile.get("elementwise_GBps"))),
                 optimizer_GBps=_number(profile.get("optimizer_GBps")),
                 launch_us=float((profile.get("launch_us") or {}).get(dtype, Rates.launch_us)),
                 launch_us_recompute=_number((profile.get("launch_us_recompute") or {}).get(dtype)),
                 overlap=bool(profile.get("host_overlap", True)),
                 ops=OpCounts(**{k: float(v) for k, v in ((profile.get("ops") or {}).get(dtype) or {}).items()
                                 if k in OpCounts.__dataclass_fields__}),
                 gemm=_points(profile, "gemm_tflops", dtype), scores=_points(profile, "scores_tflops", dtype))


def _points(profile: dict, key: str, dtype: str) -> tuple:
    """The profile's rates by shape for `dtype` ([3 sizes, forward, backward] each), as tuples."""
    return tuple(tuple(float(x) for x in point) for point in (profile.get(key) or {}).get(dtype) or ())


def _number(value) -> float | None:
    return None if value is None else float(value)


def device_part(profile: dict, *, path) -> "GPU":
    """The profile's device as plan train's part when the GPU table does not know it (a CPU, an unlisted
    GPU): its memory (memory_GB), its measured matmul rates as the peaks MFU divides by, its measured
    memory bandwidth, no NVLink or network (collectives come from the profile's busbw where measured)."""
    from lmsys.core.hardware import GPU

    if not profile.get("memory_GB"):
        raise LmsysError(f"--profile {path}: {profile['device']!r} is not in the GPU table and the profile has no "
                         "memory_GB (plan calibrate writes it since issue 30): calibrate again, or give --gpu NAME or "
                         "--cluster FILE.yaml for its memory and links")
    peaks = {d: float(profile["matmul_tflops"][d]) if d in profile["matmul_tflops"] else None
             for d in ("bf16", "fp16", "fp32")}
    source = f"measured by lmsys plan calibrate ({path})"
    return GPU(name=str(profile["device"]), patterns=(), bf16=peaks["bf16"], fp16=peaks["fp16"], tf32=None,
               fp32=peaks["fp32"], fp8=None, hbm_GB=float(profile["memory_GB"]), hbm_GBps=float(profile["hbm_GBps"]),
               nvlink_GBps=0.0, nvlink_gpus=1, pcie_GBps=float(profile.get("intra_GBps") or 0.0), network_GBps=None,
               sources={k: source for k in ("compute", "memory", "links", "network")})
