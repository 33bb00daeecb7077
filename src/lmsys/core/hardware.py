"""The GPU table (peaks, memory, links) as data, looked up by the name torch reports, and the one MFU helper.

Peaks are dense (no 2:4 sparsity): where a datasheet prints only the sparse figure (marked * there), the
dense one is half of it. Bandwidths are the datasheet's: HBM one way; NVLink the total of both directions
per GPU (the time model in lmsys.plan halves it); network the line rate of the NICs one GPU owns in the
vendor's 8-GPU system, one way. A GPU not in the table is refused, never guessed (issue 30 item 2).
Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lmsys.core.errors import LmsysError

# The sources every figure below comes from (one per part and kind of figure).
A100_WP = "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020) / A100 datasheet (2021)"
DGX_A100 = "NVIDIA DGX A100 datasheet (2020): 8x ConnectX-6 HDR 200 Gb/s, one per GPU"
H100_WP = "NVIDIA H100 Tensor Core GPU datasheet (2023) / Hopper architecture whitepaper (2022)"
DGX_H100 = "NVIDIA DGX H100 datasheet (2023): 8x ConnectX-7 400 Gb/s, one per GPU"
H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (2024)"
DGX_H200 = "NVIDIA DGX H200 datasheet (2024): 8x ConnectX-7 400 Gb/s, one per GPU"
B200_DS = "NVIDIA HGX B200 specifications (2024), 8-GPU figures / 8, sparse / 2"
DGX_B200 = "NVIDIA DGX B200 datasheet (2024): 8x ConnectX-7 400 Gb/s, one per GPU"
PCIE_NET = "no vendor system: network not specified (give it in --cluster)"
FA2_A100 = ("Dao, FlashAttention-2 (arXiv 2307.08691), abstract: 50-73 % of the A100's peak forward and backward; "
            "the low end")
FA2_HOPPER = ("Shah et al., FlashAttention-3 (arXiv 2407.08608), abstract: FlashAttention-2 reaches 35 % of the "
              "H100's peak; the same die in the H200")

# The matmul curve (issue 42): a GEMM of F FLOPs takes F / (peak · matmul) + GEMM_LAUNCH_US. Both numbers are
# the least-squares fit to the 50 bf16 GEMM timings (25 shapes: forward, and the backward's two GEMMs) that
# `plan calibrate` measured on an H200 (docs/benchmarks/plan-h200-profile.yaml; lmsys.plan.calibrate.matmul_curve,
# which calibrate prints for the GPU it runs on): 0.770 of the dense peak and
# 3.15 µs a GEMM (the fit's mean |error| 4.2 %, max 11.5 %). One curve for every part: the generations'
# best-shape bursts differ (stas00/ml-engineering compute/accelerator/README.md @744d01e, MAMF BF16: A100 SXM
# 86.9 %, H100 SXM 80.3 %, B200 77.6 % of peak), but scaling the fit by those ratios made every A100 row of
# the published set and of Korthikanti et al. more optimistic (mean |error| 14.3 % against 13.4 %): not applied.
MATMUL_FIT = 0.770
GEMM_LAUNCH_US = 3.15
PROFILE_FIT = ("least-squares fit to the bf16 GEMMs of docs/benchmarks/plan-h200-profile.yaml (plan calibrate, "
               "H200): 0.770 of peak + 3.15 µs a GEMM, for every part")
# Hopper at its power limit (issue 42): calibrate's GEMMs are bursts of a few calls, which run above the clock a
# training run keeps for hours at 700 W. Issued back to back, the same GEMMs settle lower: on an H100 SXM
# `lmsys plan calibrate --size scripts/gpu/llama2-7b.yaml,scripts/gpu/llama2-13b.yaml,gpt-175b --dtype bf16
# --batch-size 2 --sustain 10` gave 690.7 TFLOP/s over 15 shapes = 0.698 of the dense peak (SM 1380 MHz at
# 695 W; bursts 612-811; docs/benchmarks/plan-h100-sustain.md), on an H200 SXM the same shapes' 1-s windows
# 641-691 TFLOP/s, mean 672 = 0.679 (docs/benchmarks/plan-h200-sustained-matmul.txt). Each SXM part takes
# its own; the NVL and PCIe parts (350-400 W, not measured) the SXM part's of their memory. The launch term
# stays the burst fit's (the sustained shapes are all large: they cannot separate it). The A100 (400 W,
# MAMF 86.9 % of peak against the H100's 80.3 %) and the B200 keep MATMUL_FIT: not measured here.
H100_SUSTAINED = 0.698
H200_SUSTAINED = 0.679
H100_FIT = ("bf16 GEMMs back to back on an H100 SXM at 700 W (plan calibrate --sustain 10; "
            "docs/benchmarks/plan-h100-sustain.md): 0.698 of peak, + 3.15 µs a GEMM (the H200 burst fit's)")
H200_FIT = ("bf16 GEMMs back to back on an H200 SXM at 700 W (docs/benchmarks/plan-h200-sustained-matmul.txt): "
            "0.679 of peak, + 3.15 µs a GEMM (the burst fit's)")
# Capacity as nvidia-smi reports it (MiB), where it was read on this workplace's machines
# (/work/.library/device/KINDS.md: 'NVIDIA H100 80GB HBM3 with 81559 MiB', 'NVIDIA H200 with 143771 MiB');
# elsewhere the datasheet's GB.
# SMs: 132 on an H100 SXM and an H200 (PyTorch's multi_processor_count on the device machines, KINDS.md), 108
# on an A100 (A100 whitepaper: 108 SMs of the GA100's 128 enabled).
SMI = "nvidia-smi memory.total read on an H100 80GB HBM3 / an H200 (the device machines' KINDS.md)"

DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")


@dataclass(frozen=True)
class GPU:
    """One part. TFLOP/s dense; GB = 1e9 bytes; GB/s = 1e9 bytes/s."""

    name: str
    patterns: tuple[str, ...]  # every one must occur in torch's device name (lower case)
    bf16: float
    fp16: float
    tf32: float
    fp32: float
    fp8: float | None
    hbm_GB: float
    hbm_GBps: float
    nvlink_GBps: float  # per GPU, both directions added (datasheet); 0: none
    nvlink_gpus: int  # GPUs one NVLink domain joins (8: NVSwitch board; 2: a bridge pair)
    pcie_GBps: float  # per GPU, both directions added
    network_GBps: float | None  # per GPU, one direction (None: not specified)
    sources: dict[str, str] = field(default_factory=dict)  # compute / memory / links / network -> source
    exclude: tuple[str, ...] = ()  # none may occur (a GB200's B200 is another part)
    # the fraction of the dense 16-bit peak a fused flash-attention kernel of the FlashAttention-2
    # generation (what torch SDPA, MPT's triton kernel and Megatron ran through 2024) reaches forward and
    # backward, with its source; None: lmsys.plan.time.Efficiency.attention
    flash: float | None = None
    flash_source: str = ""
    # the matmul curve: the fraction of the dense peak a large GEMM sustains, and the fixed time each GEMM
    # adds (launch and tail), with their source; None: lmsys.plan.time.Efficiency.matmul and no launch time
    matmul: float | None = None
    gemm_launch_us: float = 0.0
    matmul_source: str = ""
    # the memory a process can use as nvidia-smi reports it (MiB), where read; None: hbm_GB
    memory_MiB: float | None = None
    # streaming multiprocessors (the share a collective takes from compute: lmsys.plan.time.NCCL_SMS / sms);
    # None: not modelled
    sms: int | None = None

    @property
    def capacity_bytes(self) -> float:
        """Bytes of GPU memory: nvidia-smi's MiB where the table has them, else the datasheet's GB."""
        return self.memory_MiB * 2**20 if self.memory_MiB else self.hbm_GB * 1e9

    def peak(self, dtype: str) -> float | None:
        return getattr(self, dtype)


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("B200", ("b200",), bf16=2250.0, fp16=2250.0, tf32=1125.0, fp32=75.0, fp8=4500.0,
        hbm_GB=180.0, hbm_GBps=8000.0, nvlink_GBps=1800.0, nvlink_gpus=8, pcie_GBps=128.0, network_GBps=50.0,
        sources={"compute": B200_DS, "memory": B200_DS, "links": B200_DS, "network": DGX_B200}, exclude=("gb200",),
        matmul=MATMUL_FIT, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=PROFILE_FIT),
    GPU("H200 NVL", ("h200", "nvl"), bf16=835.5, fp16=835.5, tf32=417.5, fp32=60.0, fp8=1670.5,
        hbm_GB=141.0, hbm_GBps=4800.0, nvlink_GBps=900.0, nvlink_gpus=4, pcie_GBps=128.0, network_GBps=None,
        sources={"compute": H200_DS, "memory": H200_DS, "links": H200_DS, "network": PCIE_NET}, flash=0.35, flash_source=FA2_HOPPER,
        matmul=H200_SUSTAINED, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=H200_FIT, sms=132),
    GPU("H200 SXM", ("h200",), bf16=989.5, fp16=989.5, tf32=494.5, fp32=67.0, fp8=1979.0,
        hbm_GB=141.0, hbm_GBps=4800.0, nvlink_GBps=900.0, nvlink_gpus=8, pcie_GBps=128.0, network_GBps=50.0,
        sources={"compute": H200_DS, "memory": H200_DS, "links": H200_DS, "network": DGX_H200}, flash=0.35, flash_source=FA2_HOPPER,
        matmul=H200_SUSTAINED, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=H200_FIT, memory_MiB=143771.0, sms=132),
    GPU("H100 NVL", ("h100", "nvl"), bf16=835.5, fp16=835.5, tf32=417.5, fp32=60.0, fp8=1670.5,
        hbm_GB=94.0, hbm_GBps=3900.0, nvlink_GBps=600.0, nvlink_gpus=2, pcie_GBps=128.0, network_GBps=None,
        sources={"compute": H100_WP, "memory": H100_WP, "links": H100_WP, "network": PCIE_NET}, flash=0.35, flash_source=FA2_HOPPER,
        matmul=H100_SUSTAINED, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=H100_FIT),
    GPU("H100 PCIe", ("h100", "pcie"), bf16=756.5, fp16=756.5, tf32=378.0, fp32=51.0, fp8=1513.0,
        hbm_GB=80.0, hbm_GBps=2000.0, nvlink_GBps=600.0, nvlink_gpus=2, pcie_GBps=128.0, network_GBps=None,
        sources={"compute": H100_WP, "memory": H100_WP, "links": H100_WP, "network": PCIE_NET}, flash=0.35, flash_source=FA2_HOPPER,
        matmul=H100_SUSTAINED, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=H100_FIT),
    GPU("H100 SXM", ("h100",), bf16=989.5, fp16=989.5, tf32=494.5, fp32=67.0, fp8=1979.0,
        hbm_GB=80.0, hbm_GBps=3350.0, nvlink_GBps=900.0, nvlink_gpus=8, pcie_GBps=128.0, network_GBps=50.0,
        sources={"compute": H100_WP, "memory": H100_WP, "links": H100_WP, "network": DGX_H100}, flash=0.35, flash_source=FA2_HOPPER,
        matmul=H100_SUSTAINED, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=H100_FIT, memory_MiB=81559.0, sms=132),
    GPU("A100 80GB PCIe", ("a100", "pcie", "80"), bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, fp8=None,
        hbm_GB=80.0, hbm_GBps=1935.0, nvlink_GBps=600.0, nvlink_gpus=2, pcie_GBps=64.0, network_GBps=None,
        sources={"compute": A100_WP, "memory": A100_WP, "links": A100_WP, "network": PCIE_NET}, flash=0.5, flash_source=FA2_A100,
        matmul=MATMUL_FIT, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=PROFILE_FIT, sms=108),
    GPU("A100 40GB PCIe", ("a100", "pcie"), bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, fp8=None,
        hbm_GB=40.0, hbm_GBps=1555.0, nvlink_GBps=600.0, nvlink_gpus=2, pcie_GBps=64.0, network_GBps=None,
        sources={"compute": A100_WP, "memory": A100_WP, "links": A100_WP, "network": PCIE_NET}, flash=0.5, flash_source=FA2_A100,
        matmul=MATMUL_FIT, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=PROFILE_FIT, sms=108),
    GPU("A100 80GB SXM", ("a100", "80"), bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, fp8=None,
        hbm_GB=80.0, hbm_GBps=2039.0, nvlink_GBps=600.0, nvlink_gpus=8, pcie_GBps=64.0, network_GBps=25.0,
        sources={"compute": A100_WP, "memory": A100_WP, "links": A100_WP, "network": DGX_A100}, flash=0.5, flash_source=FA2_A100,
        matmul=MATMUL_FIT, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=PROFILE_FIT, sms=108),
    GPU("A100 40GB SXM", ("a100",), bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, fp8=None,
        hbm_GB=40.0, hbm_GBps=1555.0, nvlink_GBps=600.0, nvlink_gpus=8, pcie_GBps=64.0, network_GBps=25.0,
        sources={"compute": A100_WP, "memory": A100_WP, "links": A100_WP, "network": DGX_A100}, flash=0.5, flash_source=FA2_A100,
        matmul=MATMUL_FIT, gemm_launch_us=GEMM_LAUNCH_US, matmul_source=PROFILE_FIT, sms=108),
)}


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def find_gpu(name: str | None) -> GPU | None:
    """The table's entry for a device name as torch reports it ('NVIDIA H100 80GB HBM3'), or a table
    name ('H100 SXM', 'h100-sxm'); None when nothing matches. Entries are tried most specific first."""
    if not name:
        return None
    key = _key(name)
    for gpu in GPUS.values():
        if key == _key(gpu.name):
            return gpu
    for gpu in GPUS.values():
        if all(p in key for p in gpu.patterns) and not any(x in key for x in gpu.exclude):
            return gpu
    return None


def get_gpu(name: str, *, option: str = "--gpu") -> GPU:
    """find_gpu, or the one-line refusal that lists the known parts."""
    gpu = find_gpu(name)
    if gpu is None:
        raise LmsysError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give its figures with {option})")
    return gpu


def mfu_peak(device_name: str | None, dtype: str, *, tf32: bool = False,
             option: str = "--peak-tflops") -> tuple[float, str]:
    """(dense peak TFLOP/s, label) for MFU on the GPU called `device_name` in `dtype` (fp32 with TF32 on:
    the TF32 rate). The label names the part, the rate and its source, for a report's header. A GPU the
    table does not know, or a dtype it has no peak for, is a one-line error naming `option`."""
    if dtype not in DTYPES:
        raise LmsysError(f"no peak for dtype {dtype!r}; one of {', '.join(DTYPES)}")
    gpu = find_gpu(device_name)
    if gpu is None:
        raise LmsysError(f"no peak TFLOP/s for GPU {device_name!r}; known: {', '.join(GPUS)}; "
                         f"give the peak with {option}")
    rate_dtype = "tf32" if (dtype == "fp32" and tf32) else dtype
    peak = gpu.peak(rate_dtype)
    if peak is None:
        raise LmsysError(f"{gpu.name} has no {rate_dtype} tensor-core rate; give the peak with {option}")
    return peak, peak_label(gpu.name, rate_dtype, peak)


def check_peak(tflops: float | None, *, option: str = "--peak-tflops") -> float | None:
    """A peak given on the command line: positive and finite, else a one-line error."""
    if tflops is not None and not 0 < tflops < float("inf"):
        raise LmsysError(f"{option} must be a positive number of TFLOP/s, got {tflops:g}")
    return tflops


def peak_label(part: str, dtype: str, tflops: float) -> str:
    return f"{part} dense {dtype} {tflops:g} TFLOP/s"


def mfu(flops: float, ms: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: flops done in `ms` over the peak (TFLOP/s of all GPUs that did them)."""
    from lmsys.core.flops import mfu as _mfu  # the one formula, kept where its callers import it

    return _mfu(flops, ms, peak_tflops)
