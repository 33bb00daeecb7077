"""Device selection, the facts that make a benchmark reproducible, peak rates for MFU, memory, and the
SM carveout that keeps matmuls off some SMs for the kernels beside them."""

from __future__ import annotations

import functools
import platform
from contextlib import contextmanager
from typing import Any, Iterator

from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose

DEVICE_CHOICES = ("auto", "cuda", "cpu")
DTYPE_CHOICES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = dict(zip(DTYPE_CHOICES, (4, 2, 2)))  # element width of each, for torch-free size checks

def resolve_device(name: str = "auto"):
    """'auto' -> cuda if available, else cpu. Asking for cuda without one is a user error."""
    import torch

    if name not in DEVICE_CHOICES and not name.startswith("cuda:"):
        choose(name, DEVICE_CHOICES, what="--device")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LmsysError("--device cuda: no CUDA GPU is visible to PyTorch", hint="use --device cpu")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LmsysError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
        return dev
    return torch.device("cpu")


def torch_dtype(name: str):
    import torch

    table = dict(zip(DTYPE_CHOICES, (torch.float32, torch.bfloat16, torch.float16)))  # the one dtype table
    return table[choose(name, DTYPE_CHOICES, what="--dtype")]


def check_dtype_for_device(dtype: str, device) -> None:
    """fp16 autocast is a CUDA feature here; bf16 needs an Ampere or newer GPU."""
    import torch

    torch_dtype(dtype)
    if device.type == "cpu" and dtype == "fp16":
        raise LmsysError("--dtype fp16 needs a CUDA GPU (fp16 autocast and grad scaling); use bf16 or fp32 on the CPU")
    if device.type == "cuda" and dtype == "bf16" and not torch.cuda.is_bf16_supported():
        raise LmsysError(f"--dtype bf16 is not supported by {torch.cuda.get_device_name(device)}; use fp16")


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def environment(device, *, peak_tflops: float | None = None) -> dict[str, Any]:
    """The facts printed at the top of every benchmark; `peak_tflops`: the peak a --peak-tflops gave
    (default: the one `given_peak` set, if any)."""
    import torch

    peak_tflops = _GIVEN_PEAK[-1] if peak_tflops is None else peak_tflops

    info: dict[str, Any] = {"device": f"{device.type}: {device_name(device)}"}
    if device.type == "cuda":
        info["device"] += f" ({torch.cuda.device_count()} visible, CUDA {torch.version.cuda})"
    info["torch"] = torch.__version__
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    info["python"] = platform.python_version()
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        info["tf32"] = "on (fp32 matmuls use TF32 tensor cores)"
    if peak_tflops is not None:
        info["MFU peak"] = f"{peak_tflops:g} TFLOP/s dense per device (--peak-tflops)"
    elif device.type == "cuda":
        info["MFU peak"] = peak_rates(device_name(device))
    return info


def peak_rates(name: str) -> str:
    """The dense peaks MFU divides by on the GPU called `name` (a report header line), from core.hardware."""
    from lmsys.core.hardware import find_gpu

    gpu = find_gpu(name)
    if gpu is None:
        return (f"{name} is not in lmsys.core.hardware's table: MFU left empty (give its dense peak with "
                "--peak-tflops X)")
    rates = ", ".join(f"{d} {gpu.peak(d):g}" for d in ("bf16", "fp16", "tf32", "fp32") if gpu.peak(d))
    return f"{gpu.name}, dense TFLOP/s {rates} ({gpu.sources['compute']})"


def gpu_name(device) -> str | None:
    """The GPU's name (what the peak table is keyed by), or None off a GPU."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def peak_tflops_for(name: str | None, dtype: str, *, tf32: bool) -> float | None:
    """Peak dense TFLOP/s of the GPU called `name` for `dtype` (fp32 with TF32 on: the TF32 rate), from
    lmsys.core.hardware's table; None for no GPU, a GPU the table does not know, or no rate for dtype."""
    from lmsys.core.hardware import find_gpu

    gpu = find_gpu(name)
    if gpu is None:
        return None
    return gpu.peak("tf32" if (dtype == "fp32" and tf32) else dtype)


def peak_label(device, dtype: str, *, tf32: bool | None = None) -> str | None:
    """What peak_tflops divided by, for a report's header ('H100 SXM dense bf16 989.5 TFLOP/s'), or None."""
    import torch

    from lmsys.core.hardware import find_gpu, peak_label as label

    if tf32 is None:
        tf32 = torch.backends.cuda.matmul.allow_tf32
    gpu = find_gpu(gpu_name(device))
    rate = "tf32" if (dtype == "fp32" and tf32) else dtype
    if gpu is None or gpu.peak(rate) is None:
        return None
    return label(gpu.name, rate, gpu.peak(rate))


_GIVEN_PEAK: list = [None]


@contextmanager
def given_peak(tflops: float | None) -> Iterator[None]:
    """Inside it, `peak_tflops` and `environment` use `tflops` (a --peak-tflops a rank job received)."""
    _GIVEN_PEAK.append(tflops)
    try:
        yield
    finally:
        _GIVEN_PEAK.pop()


def peak_tflops(device, dtype: str, *, tf32: bool | None = None, given: float | None = None) -> float | None:
    """Peak dense TFLOP/s for MFU on `device` (every MFU in lmsys divides by this): `given` (a
    --peak-tflops) if any, else lmsys.core.hardware's table; `tf32` defaults to torch's matmul setting."""
    import torch

    given = _GIVEN_PEAK[-1] if given is None else given
    if given is not None:
        return given
    if tf32 is None:
        tf32 = torch.backends.cuda.matmul.allow_tf32
    return peak_tflops_for(gpu_name(device), dtype, tf32=tf32)


# ---------------------------------------------------------------------------------------------- memory


def reset_peak_memory(device) -> None:
    import torch

    if device.type == "cuda":  # the allocator's counters live on the host: no synchronisation needed
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> int | None:
    """Peak bytes allocated by PyTorch since the last reset (None on the CPU: not tracked there)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


def current_memory(device) -> int | None:
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return None


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def oom_row(status: str, columns: tuple[str, ...] = (), **ident) -> dict:
    """The row of a run that did not finish (out of memory, or a user-level error): its identity, every
    other column of `columns` empty, and `status` ("OOM ...", "error: ...") in its column, else last."""
    row = dict.fromkeys(columns)
    row.update(ident)
    row["status"] = status
    return row


def free_memory(device) -> None:
    """After an OOM: drop cached blocks so the next configuration starts clean."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class MatmulCarveout:
    """While on, CUDA matmuls target (SM count - `sms`) SMs, leaving `sms` to the kernels beside them
    (NCCL's in DDP, the in-backward AdamW's in a training step): torch's experimental SM carveout,
    which cuBLASLt reads, with matmuls routed to cuBLASLt meanwhile. `on()` and `off()` restore what
    was set before; both are no-ops off a GPU."""

    def __init__(self, sms: int, device):
        import torch

        if sms < 0:
            raise ValueError(f"sms must be >= 0, got {sms}")
        device = torch.device(device)
        check_carveout(sms, device)  # the one rule, a user error wherever the carveout comes from
        self.sms = sms
        self.enabled = device.type == "cuda"
        self._saved = None

    def on(self) -> None:
        if not self.enabled or self._saved is not None:
            return
        import warnings

        import torch

        self._saved = (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental())
        torch.backends.cuda.preferred_blas_library("cublaslt")
        with warnings.catch_warnings():  # torch warns once that the knob is experimental
            warnings.simplefilter("ignore")
            torch._C._set_sm_carveout_experimental(self.sms)

    def off(self) -> None:
        if self._saved is None:
            return
        import torch

        library, carveout = self._saved
        torch.backends.cuda.preferred_blas_library(library)
        torch._C._set_sm_carveout_experimental(carveout)
        self._saved = None


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    import torch

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def capability(device) -> tuple[int, int]:
    """CUDA compute capability (major, minor) of a device; cached, as kernels ask on every launch."""
    import torch

    device = torch.device(device)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(index))


def check_carveout(sms: int | None, device) -> None:
    """A matmul SM carveout must leave the matmuls at least one SM of this GPU (one line, exit 2)."""
    if sms is not None and device.type == "cuda" and sms >= (total := sm_count(device)):
        raise LmsysError(f"--sm-carveout {sms} leaves no SM to the matmuls: this GPU has {total}")
